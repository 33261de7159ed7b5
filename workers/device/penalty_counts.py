"""The driver's token tables for penalised sequences, kept on the device from step to step.

Presence and frequency penalties read how often each token occurs in a sequence's output,
and the repetition penalty also which tokens its prompt holds. Rebuilding those [V] rows from
the whole output every step costs the host O(output length) per step; instead each penalised
sequence owns a row of one [slots, V] table on the device, filled from the host once (when the
sequence first samples here: after a preemption its outputs so far come with it), and then
incremented on the device by each step's sampled token. The increment reads the sampled
tokens where they are, so it works as well for a token whose value the host does not know yet
(async scheduling, workers/device/in_flight.py), and needs no host sync.

A row lives as long as the worker holds the sequence: `release` when the engine removes it
(finished, aborted, preempted) or sends it whole again.
"""

from __future__ import annotations

import torch
from torch import Tensor

from workers.device.layers.sampling_batch import upload
from workers.device.model_runner import SeqState

_FIRST_SLOTS = 8


class PenaltyCounts:
    """[slots, V] output-token counts (float32, as the penalties read them) and, once some
    sequence has a repetition penalty, a [slots, V] prompt-token mask; a slot per penalised
    sequence."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros((_FIRST_SLOTS, vocab_size), dtype=torch.float32, device=device)
        self.prompt_mask: Tensor | None = None
        self.slots: dict[str, int] = {}
        self._free = list(range(_FIRST_SLOTS - 1, -1, -1))
        # Token ids read from the host to fill slots, in all: only a sequence's first sampling
        # step (here) reads its tokens, so this does not grow with later steps.
        self.host_tokens_read = 0

    def release(self, seq_id: str) -> None:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def tables(self, rows: list[SeqState]) -> tuple[Tensor, Tensor, Tensor | None]:
        """The penalised rows' slots ([P] long, on the device), their output counts [P, V]
        and their prompt mask [P, V] (None when none of them has a repetition penalty). A
        row's tokens are read only when it has no slot yet: its first sampling step here,
        when the worker knows all its tokens (none is in flight)."""
        slots = [self._slot(s) for s in rows]
        slot_t = upload(torch.tensor(slots, dtype=torch.long), self.device)
        counts = self.counts.index_select(0, slot_t)
        mask = None
        if self.prompt_mask is not None and any(s.params.repetition_penalty != 1.0 for s in rows):
            mask = self.prompt_mask.index_select(0, slot_t)
        return slot_t, counts, mask

    def record(self, slot_t: Tensor, rows: Tensor, sampled: Tensor) -> None:
        """Counts this step's sampled tokens, on the device: `sampled[rows[i]]` into slot
        `slot_t[i]`."""
        # index_add_ (atomic adds on CUDA) into the flat table: no host sync, and adding
        # ones in any order gives the same integer counts.
        flat = slot_t * self.vocab_size + sampled.index_select(0, rows)
        ones = torch.ones(flat.shape, dtype=torch.float32, device=self.device)
        self.counts.view(-1).index_add_(0, flat, ones)

    def _slot(self, state: SeqState) -> int:
        slot = self.slots.get(state.seq_id)
        if slot is not None:
            return slot
        if state.num_placeholders:  # its counts would miss a token
            raise RuntimeError(f"{state.seq_id}: first penalised step with unknown tokens")
        params, tokens, prompt_len = state.params, state.token_ids, state.prompt_len
        if not self._free:
            self._grow()
        slot = self.slots[state.seq_id] = self._free.pop()
        self.counts[slot] = 0
        outputs = tokens[prompt_len:]
        self.host_tokens_read += len(outputs)
        if outputs:
            ids = upload(torch.tensor(outputs, dtype=torch.long), self.device)
            ones = torch.ones(len(outputs), dtype=torch.float32, device=self.device)
            self.counts[slot].index_add_(0, ids, ones)
        if params.repetition_penalty != 1.0 and self.prompt_mask is None:
            self.prompt_mask = torch.zeros(self.counts.shape, dtype=torch.bool, device=self.device)
        if self.prompt_mask is not None:
            self.prompt_mask[slot] = False
            if params.repetition_penalty != 1.0 and prompt_len:
                self.host_tokens_read += prompt_len
                ids = upload(torch.tensor(tokens[:prompt_len], dtype=torch.long), self.device)
                self.prompt_mask[slot].index_fill_(0, ids, True)
        return slot

    def _grow(self) -> None:
        """Twice the slots; the old rows keep their place (a copy on the device)."""
        old = self.counts.shape[0]
        counts = torch.zeros((2 * old, self.vocab_size), dtype=torch.float32, device=self.device)
        counts[:old] = self.counts
        self.counts = counts
        if self.prompt_mask is not None:
            mask = torch.zeros(counts.shape, dtype=torch.bool, device=self.device)
            mask[:old] = self.prompt_mask
            self.prompt_mask = mask
        self._free.extend(range(2 * old - 1, old - 1, -1))
