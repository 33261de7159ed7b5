"""One engine step's sampling metadata (`SamplingBatch`), built once per step on the logits'
device: per-row options as batched tensors, and only the tensors some row needs (None
otherwise), so a step pays only for what its rows asked for. `workers.device.layers.sampler` and
`workers.device.layers.logits_processors` read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from torch import Tensor

from workers.sampling_params import SamplingParams

# Stored for rows that switch top-p off: a prefix's preceding mass never reaches 2, so the row
# is untouched even when float rounding pushes a cumulative sum a hair above 1.
_TOP_P_OFF = 2.0
# Tokens a top-p row without top-k looks at before falling back to sorting the vocabulary.
_TOP_P_PROBE = 1024


@dataclass(frozen=True)
class SamplingBatch:
    """One step's sampling metadata, on the logits' device. Build it with `SamplingBatch.build`.

    Optional tensors are None when no row needs them. Per-row tensors for penalties cover only
    the rows listed in `penalty_rows` (all rows when it is None).
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    greedy: Tensor | None  # [B] bool; only in a batch mixing greedy and random rows
    temperature: Tensor | None  # [B] float; None when all rows are greedy (greedy rows hold 1)
    top_k: Tensor | None  # [B] long in [1, V]; rows without top-k hold V
    top_p: Tensor | None  # [B] float; rows without top-p hold _TOP_P_OFF
    candidates: int  # how many best tokens per row top-k/top-p look at first (V: a full sort)
    top_p_probe: bool  # a top-p row lacks top-k: sort all V if the candidates fall short
    min_p: Tensor | None  # [B] float; rows without min-p hold 0
    penalty_rows: Tensor | None  # [P] long: the rows with any penalty, None when all rows
    repetition_penalty: Tensor | None  # [P, 1]
    frequency_penalty: Tensor | None  # [P, 1]
    presence_penalty: Tensor | None  # [P, 1]
    output_counts: Tensor | None  # [P, V] float: occurrences of each token in the output
    prompt_mask: Tensor | None  # [P, V] bool: token occurs in the prompt (repetition only)
    blocked: tuple[Tensor, Tensor] | None  # (rows, token ids) to set to -inf (min_tokens)
    seeds: list[int | None]
    positions: list[int]  # tokens generated so far, per row
    seeded_rows: list[int]  # non-greedy rows with a seed: they draw their own noise
    shared_noise: bool  # some non-greedy row has no seed: draw from the Sampler's generator
    num_logprobs: list[int | None]  # per row, as requested
    max_logprobs: int  # the largest top-N requested, -1 when no row wants logprobs
    # Constrained decoding: the rows with a grammar and their packed allowed-token masks
    # ([G, ceil(V / 32)] int32, bit t % 32 of word t // 32 for token t); None when none.
    grammar_rows: Tensor | None = None  # [G] long
    grammar_bits: Tensor | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        *,
        device: torch.device | str,
        vocab_size: int,
        blocked_token_ids: list[list[int]] | None = None,
        grammar: tuple[list[int], Tensor] | None = None,
    ) -> SamplingBatch:
        """Collect per-row options into batched tensors.

        `prompt_token_ids` is read only for rows with a repetition penalty and
        `output_token_ids` only for rows with a penalty (plus its length, for positions and
        min_tokens); ids must be < vocab_size. `blocked_token_ids` overrides which ids each row
        has blocked this step; by default a row shorter than min_tokens blocks its stop ids and
        (unless ignore_eos) its EOS ids. `grammar` is (rows, packed bitmask rows, a CPU or
        device int32 tensor) for the constrained rows.
        """
        num_rows = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == num_rows):
            raise ValueError("params, prompt_token_ids and output_token_ids differ in length")
        device = torch.device(device)
        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
        tables = _token_tables(
            [params[i] for i in pen_rows],
            [prompt_token_ids[i] for i in pen_rows],
            [output_token_ids[i] for i in pen_rows],
            vocab_size,
            device,
        )
        return cls.assemble(
            params,
            [len(out) for out in output_token_ids],
            tables,
            device=device,
            vocab_size=vocab_size,
            blocked_token_ids=blocked_token_ids,
            grammar=grammar,
        )

    @classmethod
    def assemble(
        cls,
        params: list[SamplingParams],
        positions: list[int],
        penalty_tables: tuple[Tensor | None, Tensor | None],
        *,
        device: torch.device | str,
        vocab_size: int,
        blocked_token_ids: list[list[int]] | None = None,
        grammar: tuple[list[int], Tensor] | None = None,
    ) -> SamplingBatch:
        """`build` from each row's output length (`positions`) and the penalised rows' token
        tables, already on the device: (output counts [P, V] float, prompt mask [P, V] bool
        or None), P the rows with a penalty in row order; (None, None) when there are none.
        The worker keeps those tables on the device from step to step
        (workers/device/penalty_counts.py), so a step reads no output token lists."""
        num_rows = len(params)
        device = torch.device(device)
        greedy = [p.greedy for p in params]
        seeds = [p.seed for p in params]
        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
        output_counts, prompt_mask = penalty_tables

        # Per-row scalars travel to the device in one transfer (see _rows_to_device).
        columns, candidates, top_p_probe = _filter_columns(
            params, greedy, vocab_size, probe=device.type == "cpu"
        )
        columns.update(_penalty_columns([params[i] for i in pen_rows]))
        t = _rows_to_device(columns, device)

        if blocked_token_ids is None:
            blocked_token_ids = [
                _min_tokens_block(p) if p.min_tokens > n else []
                for p, n in zip(params, positions, strict=True)
            ]
        # Out-of-vocabulary stop ids can never be sampled; dropping them keeps index_put valid.
        blocked_lists = [[i for i in ids if 0 <= i < vocab_size] for ids in blocked_token_ids]

        num_logprobs = [p.logprobs for p in params]
        requested = [n for n in num_logprobs if n is not None]
        top_k, greedy_mask = t.get("top_k"), t.get("greedy")
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            greedy=greedy_mask.bool() if greedy_mask is not None else None,
            temperature=t.get("temperature"),
            top_k=top_k.long() if top_k is not None else None,
            top_p=t.get("top_p"),
            candidates=candidates,
            top_p_probe=top_p_probe,
            min_p=t.get("min_p"),
            penalty_rows=(
                upload(torch.tensor(pen_rows), device)
                if pen_rows and len(pen_rows) < num_rows
                else None
            ),
            repetition_penalty=_column(t, "repetition_penalty"),
            frequency_penalty=_column(t, "frequency_penalty"),
            presence_penalty=_column(t, "presence_penalty"),
            output_counts=output_counts,
            prompt_mask=prompt_mask,
            blocked=_row_col(blocked_lists, device) if any(blocked_lists) else None,
            seeds=seeds,
            positions=positions,
            seeded_rows=[
                i
                for i, (s, g) in enumerate(zip(seeds, greedy, strict=True))
                if s is not None and not g
            ],
            shared_noise=any(s is None and not g for s, g in zip(seeds, greedy, strict=True)),
            num_logprobs=num_logprobs,
            max_logprobs=min(max(requested), vocab_size) if requested else -1,
            grammar_rows=(
                upload(torch.tensor(grammar[0], dtype=torch.long), device) if grammar else None
            ),
            grammar_bits=grammar[1].to(device, non_blocking=True) if grammar else None,
        )


def _filter_columns(
    params: list[SamplingParams], greedy: list[bool], vocab_size: int, probe: bool = True
) -> tuple[dict[str, list[float]], int, bool]:
    """Temperature / top-k / top-p / min-p columns some random row needs; see _mask_top_k_top_p
    for the other two results. `probe`: a top-p row without top-k may try the best
    _TOP_P_PROBE tokens first; checking that they sufficed reads a flag back to the host, so on
    a GPU (where that sync would stall the next step's launch) such rows sort the vocabulary."""
    if all(greedy):
        return {}, 0, False
    rows = list(zip(params, greedy, strict=True))
    columns = {"temperature": [1.0 if g else p.temperature for p, g in rows]}
    if any(greedy):
        columns["greedy"] = [float(g) for g in greedy]
    # Greedy rows hold "off" so they never widen the candidate list below.
    ks = [vocab_size if g or p.top_k == -1 else min(p.top_k, vocab_size) for p, g in rows]
    top_ps = [_TOP_P_OFF if g or p.top_p >= 1.0 else p.top_p for p, g in rows]
    if any(k < vocab_size for k in ks):
        columns["top_k"] = [float(k) for k in ks]  # exact: float32 holds integers up to 2**24
    if any(top_p < 1.0 for top_p in top_ps):
        columns["top_p"] = top_ps
    if any(p.min_p > 0.0 and not g for p, g in rows):
        columns["min_p"] = [p.min_p for p in params]
    # A row with top-k finds its survivors among its k best tokens. A top-p row without top-k
    # almost always reaches its mass within the best _TOP_P_PROBE tokens, so try those first.
    top_k_max = max((k for k in ks if k < vocab_size), default=0)
    unbounded = any(k >= vocab_size and top_p < 1.0 for k, top_p in zip(ks, top_ps, strict=True))
    probed = _TOP_P_PROBE if probe else vocab_size
    candidates = min(max(top_k_max, probed if unbounded else 0), vocab_size)
    return columns, candidates, unbounded and candidates < vocab_size


def _penalty_columns(pen_params: list[SamplingParams]) -> dict[str, list[float]]:
    columns = {}
    if any(p.repetition_penalty != 1.0 for p in pen_params):
        columns["repetition_penalty"] = [p.repetition_penalty for p in pen_params]
    if any(p.frequency_penalty != 0.0 for p in pen_params):
        columns["frequency_penalty"] = [p.frequency_penalty for p in pen_params]
    if any(p.presence_penalty != 0.0 for p in pen_params):
        columns["presence_penalty"] = [p.presence_penalty for p in pen_params]
    return columns


def _token_tables(
    pen_params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
    vocab_size: int,
    device: torch.device,
) -> tuple[Tensor | None, Tensor | None]:
    """[P, V] output token counts, and the prompt-token mask when a row has repetition penalty."""
    if not pen_params:
        return None, None
    shape = (len(pen_params), vocab_size)
    counts = torch.zeros(shape, dtype=torch.float32, device=device)
    counts.index_put_(_row_col(outputs, device), _ones(outputs, device), accumulate=True)
    if all(p.repetition_penalty == 1.0 for p in pen_params):
        return counts, None
    prompts = [
        prompt if p.repetition_penalty != 1.0 else []
        for p, prompt in zip(pen_params, prompts, strict=True)
    ]
    prompt_mask = torch.zeros(shape, dtype=torch.bool, device=device)
    prompt_mask[_row_col(prompts, device)] = True
    return counts, prompt_mask


def _min_tokens_block(params: SamplingParams) -> list[int]:
    assert params.stop_token_ids is not None  # normalised to a list by SamplingParams
    eos = [] if params.ignore_eos else list(params.eos_token_ids)
    return eos + params.stop_token_ids


def _row_col(lists: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Flatten ragged per-row id lists into (row index, id) tensors for index_put."""
    lengths = [len(x) for x in lists]
    both = np.empty((2, sum(lengths)), dtype=np.int64)
    both[0] = np.repeat(np.arange(len(lists)), lengths)
    both[1] = np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=both.shape[1])
    on_device = upload(torch.from_numpy(both), device)
    return on_device[0], on_device[1]


def _ones(lists: list[list[int]], device: torch.device) -> Tensor:
    return torch.ones(sum(len(x) for x in lists), dtype=torch.float32, device=device)


def _rows_to_device(columns: dict[str, list[float]], device: torch.device) -> dict[str, Tensor]:
    """Ship same-length float columns in one host-to-device copy, then split them by name."""
    out: dict[str, Tensor] = {}
    by_length: dict[int, list[str]] = {}
    for name, values in columns.items():
        by_length.setdefault(len(values), []).append(name)
    for names in by_length.values():
        stacked = upload(torch.tensor([columns[n] for n in names], dtype=torch.float32), device)
        out.update(zip(names, stacked.unbind(0), strict=True))
    return out


def upload(host: Tensor, device: torch.device) -> Tensor:
    """A host tensor on the device without waiting for it: on CUDA through pinned memory and a
    non-blocking copy (a copy from pageable memory waits for everything queued before it)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _column(tensors: dict[str, Tensor], name: str) -> Tensor | None:
    value = tensors.get(name)
    return value.unsqueeze(1) if value is not None else None
