"""Turns one step's scheduled sequences into flat batch tensors and runs the model.

Layout: decodes (1 query token) first, then prefill chunks; positions, slot mapping, block
tables and masks are built with numpy in one pass so per-step Python work stays small.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from workers.device.layers.attention import AttentionMetadata, PrefillSeq
from workers.device.layers.cpu_kernels import tiled_kernels
from workers.sampling_params import SamplingParams


@dataclass(eq=False)
class SeqState:
    """A worker's copy of one sequence."""

    seq_id: str
    prompt_len: int
    token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0
    num_scheduled: int = 0
    lora_slot: int = -1  # the adapter slot it runs under (-1: the base model)
    # Mean pooling (workers/pooling.py): the normed hidden states summed over the chunks so far.
    pool_sum: torch.Tensor | None = None
    # Trailing entries of token_ids this worker sampled whose values the engine has not sent
    # yet (held as 0): the next step reads such a token from the device (workers/device/
    # in_flight.py), and the engine's next diff overwrites them (`receive`).
    num_placeholders: int = 0
    # Speculative decoding: trailing entries of token_ids that are this step's draft (computed
    # and sampled at every position, then dropped: the engine sends the tokens it keeps).
    num_draft: int = 0
    # Plain greedy: argmax suffices (no penalties, logprobs or min_tokens to enforce).
    plain_greedy: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.plain_greedy = (
            p.greedy and not p.has_penalties and p.logprobs is None and p.min_tokens == 0
        )

    def receive(self, tokens: list[int], draft: list[int] = ()) -> None:
        """The engine's tokens since its last diff: first the values of the placeholders (in
        order), then tokens this worker has not seen; then this step's draft, if any."""
        k = min(len(tokens), self.num_placeholders)
        if k:
            start = len(self.token_ids) - self.num_placeholders
            self.token_ids[start : start + k] = tokens[:k]
            self.num_placeholders -= k
        self.token_ids.extend(tokens[k:])
        self.token_ids.extend(draft)
        self.num_draft = len(draft)

    def add_placeholder(self) -> None:
        """This step samples the sequence's next token: it holds a place until it is known
        (after a draft, whose kept tokens the engine sends like any sampled token)."""
        if self.num_draft:
            del self.token_ids[-self.num_draft :]
            self.num_draft = 0
        self.token_ids.append(0)
        self.num_placeholders += 1

    @property
    def num_known_tokens(self) -> int:
        """Tokens before this step's draft."""
        return len(self.token_ids) - self.num_draft


@dataclass(frozen=True)
class ChunkRows:
    """Rows of the flat batch that one sequence's scheduled tokens occupy."""

    state: SeqState
    first_row: int
    first_pos: int  # the position of the first row's token
    count: int


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # Rows whose logits the step needs: one per sampling sequence (sample_states, in order),
    # then the prompt rows of prompt_chunks, in order.
    logits_indices: torch.Tensor
    sample_states: list[SeqState]  # the first len(sample_states) rows of the logits
    # SamplingParams.prompt_logprobs: chunk rows whose next token is still a prompt token.
    prompt_chunks: list[ChunkRows] = field(default_factory=list)
    # SamplingParams.pooling: every chunk of an embedding request (workers/pooling.py).
    pool_chunks: list[ChunkRows] = field(default_factory=list)
    # LoRA: (slot, first row, rows) of each sequence under an adapter (workers/lora/layers.py).
    lora_rows: list[tuple[int, int, int]] = field(default_factory=list)


def prepare_inputs(
    states: list[SeqState],
    block_size: int,
    device: torch.device,
    cpu_kernel: object = None,
) -> ModelInput:
    """`cpu_kernel`: the loaded CPU kernel library (workers/device/layers/cpu_kernels/), or
    None for the torch path. (The triton backend's inputs: workers/device/triton_inputs.py.)"""
    decodes = [s for s in states if s.num_scheduled == 1]
    prefills = [s for s in states if s.num_scheduled > 1]
    kernel_prefills: list[SeqState] = []
    # Not where the prefill kernel has no register tiles (narrower than AVX2): SDPA per chunk.
    if cpu_kernel is not None and tiled_kernels(cpu_kernel):
        # Prefill chunks attend through the CPU kernels too, laid out right after the
        # decodes: chunks over a short context as rows of the decode kernel (a row per query
        # token), then the others, whose blocks of query tokens share each K/V read in the
        # prefill kernel (workers/device/layers/attention.py). Over a computed prefix SDPA would
        # need the context gathered and an explicit mask; fresh chunks too measured faster
        # this way than one SDPA call each (docs/benchmarks.md, "Prefill attention on CPU").
        kernel_prefills = sorted(prefills, key=_attends_blockwise)  # stable: rows first
        prefills = []
    bs = block_size

    ids: list[int] = []
    pos_parts: list[np.ndarray] = []
    slot_parts: list[np.ndarray] = []
    logits_idx: list[int] = []
    sample_states: list[SeqState] = []
    chunk_rows: list[tuple[SeqState, int]] = []  # (sequence, first row) of the step's chunks

    d = len(decodes)
    decode_tables = decode_mask = decode_lens = None
    # Block-table rows: decodes, then (kernel path) each kernel chunk's query tokens; a row
    # attends to its sequence's positions 0..p (lens = p + 1) through the sequence's table.
    kernel_rows = d + sum(s.num_scheduled for s in kernel_prefills)
    if kernel_rows:
        lens = np.empty(kernel_rows, dtype=np.int64) if cpu_kernel is not None else None
        max_blocks = max(len(s.block_ids) for s in (*decodes, *kernel_prefills))
        tables = np.zeros((kernel_rows, max_blocks), dtype=np.int64)
    if d:
        ctx = np.fromiter((s.num_computed_tokens for s in decodes), dtype=np.int64, count=d)
        ids.extend(s.token_ids[s.num_computed_tokens] for s in decodes)
        for r, s in enumerate(decodes):
            tables[r, : len(s.block_ids)] = s.block_ids
        pos_parts.append(ctx)
        slot_parts.append(tables[np.arange(d), ctx // bs] * bs + ctx % bs)
        if cpu_kernel is not None:
            lens[:d] = ctx + 1
        else:
            decode_tables = torch.from_numpy(tables).to(device, non_blocking=True)
            # Causal: a decode at position p attends to positions 0..p.
            mask = np.arange(max_blocks * bs)[None, :] <= ctx[:, None]
            decode_mask = torch.from_numpy(mask).to(device, non_blocking=True)[:, None, None, :]
        for r, s in enumerate(decodes):
            chunk_rows.append((s, r))
            if s.num_computed_tokens + 1 == len(s.token_ids):
                sample_row(s, r, logits_idx, sample_states)
    row = d
    num_row_rows = d  # rows through the decode kernel: decodes, then short-context chunks
    chunks: list[tuple[int, int, int]] = []  # prefill kernel: (first row, length, position)
    for s in kernel_prefills:
        chunk_rows.append((s, row))
        start, n, end, pos, blocks = _add_chunk(s, bs, ids, pos_parts, slot_parts)
        tables[row : row + n, : len(blocks)] = blocks
        lens[row : row + n] = pos + 1
        if _attends_blockwise(s):
            chunks.append((row, n, start))
        else:
            num_row_rows += n
        row += n
        if end == len(s.token_ids):
            sample_row(s, row - 1, logits_idx, sample_states)
    if kernel_rows and cpu_kernel is not None:
        decode_tables = torch.from_numpy(tables)
        decode_lens = torch.from_numpy(lens)

    prefill_meta: list[PrefillSeq] = []
    offset = kernel_rows
    for s in prefills:
        chunk_rows.append((s, offset))
        start, n, end, pos, blocks = _add_chunk(s, bs, ids, pos_parts, slot_parts)
        if start == 0:
            slots = mask = None
        else:
            ctx_pos = np.arange(end, dtype=np.int64)
            slots = torch.from_numpy(blocks[ctx_pos // bs] * bs + ctx_pos % bs).to(device)
            mask_np = ctx_pos[None, :] <= pos[:, None]
            mask = torch.from_numpy(mask_np).to(device)
        prefill_meta.append(PrefillSeq(offset, n, end, slots, mask))
        offset += n
        if end == len(s.token_ids):
            sample_row(s, offset - 1, logits_idx, sample_states)

    positions = np.concatenate(pos_parts) if pos_parts else np.zeros(0, dtype=np.int64)
    slots_all = np.concatenate(slot_parts) if slot_parts else np.zeros(0, dtype=np.int64)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots_all).to(device),
        num_decodes=d,
        num_kernel_rows=kernel_rows if cpu_kernel is not None else 0,
        decode_block_tables=decode_tables,
        decode_mask=decode_mask,
        prefills=prefill_meta,
        decode_lens=decode_lens,
        cpu_kernel=cpu_kernel,
        num_row_kernel_rows=num_row_rows if cpu_kernel is not None else 0,
        prefill_chunks=torch.tensor(chunks, dtype=torch.int64) if chunks else None,
    )
    prompt_chunks, pool_chunks = prompt_and_pool_chunks(chunk_rows, logits_idx)
    return ModelInput(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.from_numpy(positions).to(device),
        meta=meta,
        logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=device),
        sample_states=sample_states,
        prompt_chunks=prompt_chunks,
        pool_chunks=pool_chunks,
        lora_rows=[(s.lora_slot, r, s.num_scheduled) for s, r in chunk_rows if s.lora_slot >= 0],
    )


def sample_row(s: SeqState, row: int, logits_idx: list[int], states: list[SeqState]) -> None:
    """A sequence whose chunk reaches its last token samples from that row's logits (and a
    draft's chunk from each of its last 1 + num_draft rows, consecutively); an embedding
    request never samples (its last chunk is pooled instead)."""
    if s.params.pooling is None:
        logits_idx.extend(range(row - s.num_draft, row + 1))
        states.extend([s] * (s.num_draft + 1))


def sample_positions(states: list[SeqState]) -> list[int]:
    """Each sampled row's position among its sequence's outputs (the sampler's seeded noise
    depends on it): a draft's rows take the positions after the known tokens, in order."""
    positions: list[int] = []
    prev: SeqState | None = None
    for s in states:
        j = positions[-1] + 1 if s is prev else s.num_known_tokens - s.prompt_len
        positions.append(j)
        prev = s
    return positions


def prompt_and_pool_chunks(
    chunk_rows: list[tuple[SeqState, int]], logits_idx: list[int]
) -> tuple[list[ChunkRows], list[ChunkRows]]:
    """The chunks that need more than sampling: rows whose logits give prompt logprobs
    (appended to `logits_idx` after the sample rows) and chunks of embedding requests."""
    prompt: list[ChunkRows] = []
    pool: list[ChunkRows] = []
    for s, first_row in chunk_rows:
        start = s.num_computed_tokens
        if s.params.pooling is not None:
            pool.append(ChunkRows(s, first_row, start, s.num_scheduled))
        if s.params.prompt_logprobs is None:
            continue
        # Position p's logits score the token at p + 1: prompt positions 0 .. prompt_len - 2.
        count = min(start + s.num_scheduled, s.prompt_len - 1) - start
        if count > 0:
            prompt.append(ChunkRows(s, first_row, start, count))
            logits_idx.extend(range(first_row, first_row + count))
    return prompt, pool


# CPU: prefill chunks whose context (cached prefix + chunk) reaches this many tokens attend
# through the prefill kernel, shorter ones a row per token through the decode kernel. Measured
# per chunk length, many chunks per call, no prefix, 2 threads (docs/benchmarks.md,
# "Prefill attention on CPU"): the prefill kernel won from 16 tokens with the demo's heads
# (1.7x at 64), from 32 with the 100M checkpoint's (1.4x at 64) and from 64 with Qwen3-0.6B's
# (1.0x at 64, 1.3x at 96); over a cached prefix it wins from a few tokens (2.4x for 8
# tokens over 1,024).
PREFILL_KERNEL_MIN_CONTEXT = 64


def _attends_blockwise(s: SeqState) -> bool:
    """Whether a prefill chunk goes through the CPU prefill kernel (not a row per token)."""
    return s.num_computed_tokens + s.num_scheduled >= PREFILL_KERNEL_MIN_CONTEXT


def _add_chunk(
    s: SeqState,
    bs: int,
    ids: list[int],
    pos_parts: list[np.ndarray],
    slot_parts: list[np.ndarray],
) -> tuple[int, int, int, np.ndarray, np.ndarray]:
    """Appends a prefill chunk's tokens, positions and KV slots to the flat batch; returns
    (start, n, end, positions, block ids)."""
    start, n = s.num_computed_tokens, s.num_scheduled
    end = start + n
    ids.extend(s.token_ids[start:end])
    pos = np.arange(start, end, dtype=np.int64)
    blocks = np.asarray(s.block_ids, dtype=np.int64)
    pos_parts.append(pos)
    slot_parts.append(blocks[pos // bs] * bs + pos % bs)
    return start, n, end, pos, blocks
