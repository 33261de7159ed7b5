"""A proposer for tests: drafts from a reference run's outputs (what the model will emit),
with chosen positions made wrong, so verification's accept and reject paths both run."""

from __future__ import annotations

from workers.core.request import Seq
from workers.core.speculator import SeqSpeculation


class OracleProposer:
    def __init__(self, reference: dict[tuple, list[list[int]]], vocab: int) -> None:
        # (prompt ids, adapter name or None) -> each sample's outputs (by sample index)
        self.reference = reference
        self.vocab = vocab

    def propose_batch(self, asks: list[tuple[Seq, SeqSpeculation, int]]) -> list[list[int]]:
        return [self._propose(seq, k) for seq, _, k in asks]

    def _propose(self, seq: Seq, k: int) -> list[int]:
        name = None if seq.lora is None else seq.lora.lora_name
        outs = self.reference[(tuple(seq.prompt_token_ids), name)][seq.index]
        n = seq.num_output_tokens
        draft = list(outs[n : n + k])
        # Every third step a wrong second token: verification keeps t_0, d_1 and the bonus
        # sample at most, and the rejected tail's KV is written over later.
        if n % 3 == 0 and len(draft) > 1:
            draft[1] = (draft[1] + 1) % self.vocab
        return draft


def reference_of(outputs: list, names: list | None = None) -> dict[tuple, list[list[int]]]:
    """A plain run's outputs by (prompt ids, adapter name: `names[i]` of prompt i, or None)."""
    names = names or [None] * len(outputs)
    return {
        (tuple(o.prompt_token_ids), n): [list(c.token_ids) for c in o.outputs]
        for o, n in zip(outputs, names, strict=True)
    }
