"""What changes the logits before a token is drawn: the grammar bitmask (constrained rows),
penalties (on the raw logits), then temperature, top-k, top-p and min-p (as -inf). The order
and the rules are vLLM's; see `workers.device.layers.sampler` for where they sit in a step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from workers.device.layers.sampling_batch import SamplingBatch


def apply_token_bitmask(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Constrained rows: tokens their grammar does not allow become -inf. Returns `logits`
    itself when no row is constrained, a new tensor otherwise."""
    if batch.grammar_rows is None or batch.grammar_bits is None:
        return logits
    return mask_disallowed(logits, batch.grammar_rows, batch.grammar_bits)


def mask_disallowed(logits: Tensor, rows: Tensor, bits: Tensor) -> Tensor:
    """A copy of `logits` where row rows[i] keeps only the tokens set in bits[i] (packed
    int32, bit t % 32 of word t // 32); the others become -inf."""
    k, words = bits.shape
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(k, words * 32)
    n = min(vocab, words * 32)
    sub = logits.index_select(0, rows)  # a copy: edited in place below
    sub[:, :n].masked_fill_(~allowed[:, :n], float("-inf"))
    sub[:, n:] = float("-inf")  # ids past the mask (past the tokenizer) are never allowed
    return logits.index_copy(0, rows, sub)


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition, frequency and presence penalties; returns `logits` itself when none apply."""
    counts = batch.output_counts
    if counts is None:
        return logits
    rows = batch.penalty_rows
    sub = logits if rows is None else logits.index_select(0, rows)
    if batch.repetition_penalty is not None:
        seen = counts > 0
        if batch.prompt_mask is not None:
            seen |= batch.prompt_mask
        penalty = batch.repetition_penalty
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    if batch.frequency_penalty is not None:
        sub = sub - batch.frequency_penalty * counts
    if batch.presence_penalty is not None:
        sub = sub - batch.presence_penalty * (counts > 0)
    if rows is None:
        return sub
    return logits.index_copy(0, rows, sub)


def apply_filters(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Temperature, then top-k, top-p and min-p as -inf; a new tensor (greedy rows: unfiltered)."""
    assert batch.temperature is not None, "all-greedy batches have nothing to filter"
    scaled = logits / batch.temperature.unsqueeze(1)  # a fresh tensor: safe to edit in place
    if batch.top_k is not None or batch.top_p is not None:
        _mask_top_k_top_p(scaled, batch)
    if batch.min_p is not None:
        # p < min_p * p_max  <=>  z < z_max + log(min_p); min_p = 0 gives -inf: nothing dropped.
        floor = scaled.amax(-1, keepdim=True) + batch.min_p.log().unsqueeze(1)
        scaled.masked_fill_(scaled < floor, float("-inf"))
    return scaled


def _mask_top_k_top_p(logits: Tensor, batch: SamplingBatch) -> None:
    """Set tokens outside each row's top-k and top-p sets to -inf, in place.

    Both filters work on one list of each row's best `batch.candidates` tokens, descending (a
    topk, far cheaper than sorting the vocabulary). A top-p row without top-k whose mass is not
    reached inside that list makes the list the whole vocabulary, sorted. Both filters cut by
    value, so tokens tied with the last survivor survive too: the result never depends on how
    ties are ordered, hence never on the list's length or on which rows share the batch.
    """
    top_k, top_p, vocab_size = batch.top_k, batch.top_p, logits.shape[-1]
    values, ids = _best(logits, batch.candidates)
    neg_inf = float("-inf")
    if top_k is not None:
        kth = values.gather(1, (top_k.clamp(max=values.shape[1]) - 1).unsqueeze(1))
        kth.masked_fill_((top_k >= vocab_size).unsqueeze(1), neg_inf)
        logits.masked_fill_(logits < kth, neg_inf)
        values = values.masked_fill(values < kth, neg_inf)
    if top_p is None:
        return
    # Normalised over the whole row (the top-k survivors), not just over the list.
    probs = logits.softmax(-1)
    kept = _top_p_kept(probs, ids, top_p)
    # Only rows with top-p on can run off the end (on a host sync, paid only when probing).
    if batch.top_p_probe and bool(((kept == values.shape[1]) & (top_p <= 1.0)).any()):
        values, ids = _best(logits, vocab_size)
        kept = _top_p_kept(probs, ids, top_p)
    # At least the top token: a top_p below float32's range (5e-324) is 0 here, keeping none.
    cutoff = values.gather(1, kept.clamp(min=1).unsqueeze(1) - 1)
    cutoff.masked_fill_((top_p > 1.0).unsqueeze(1), neg_inf)
    logits.masked_fill_(logits < cutoff, neg_inf)


def _best(logits: Tensor, count: int) -> tuple[Tensor, Tensor]:
    if count < logits.shape[-1]:
        return logits.topk(count, dim=-1)
    return logits.sort(dim=-1, descending=True)


def _top_p_kept(probs: Tensor, ids: Tensor, top_p: Tensor) -> Tensor:
    """[B] length of each row's top-p prefix of `ids` (the list's length if it falls short)."""
    listed = probs.gather(1, ids)
    # Exclusive prefix sums of non-negative terms never decrease, so the kept entries form a
    # prefix; the first is exactly 0 < top_p, so the top token always stays.
    mass_before = torch.nn.functional.pad(listed.cumsum(-1)[:, :-1], (1, 0))
    return (mass_before < top_p.unsqueeze(1)).sum(-1)
