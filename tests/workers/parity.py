"""Greedy comparison against transformers that tells genuine ties from real divergence."""

from __future__ import annotations

from typing import Any

import torch

from tests.checkpoints import near_tie


def first_divergence(ours: list[int], ref: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            return i
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


def assert_greedy_match(hf_model: Any, prompt: list[int], ours: list[int], ref: list[int]) -> bool:
    """Asserts ours == ref up to a near-tie (< 1e-4 between the top two logits).

    Returns True when the sequences matched fully, False when they diverged at a tie.
    """
    i = first_divergence(ours, ref)
    if i is None:
        return True
    ids = torch.tensor([prompt + ref[:i]])
    with torch.no_grad():
        logits = hf_model(ids, attention_mask=torch.ones_like(ids)).logits[0, -1]
    assert near_tie(logits), (
        f"prompt of {len(prompt)} tokens: kvray {ours} != transformers {ref} at output "
        f"position {i}, and it is not a near-tie (top-2 gap >= 1e-4)"
    )
    return False


def assert_outputs_match_hf(path: Any, prompts: list[list[int]], outs: list[Any], n: int) -> None:
    """Each request's greedy tokens are transformers' (`n` new tokens), one near-tie allowed."""
    from tests.checkpoints import hf_greedy, load_hf

    hf = load_hf(path)
    exact = 0
    for prompt, out in zip(prompts, outs, strict=True):
        exact += assert_greedy_match(hf, prompt, out.outputs[0].token_ids, hf_greedy(hf, prompt, n))
    assert exact >= len(prompts) - 1


def assert_greedy_and_logprobs_match(
    hf_model: Any, prompts: list[list[int]], outs: list[Any], n: int, tol: float = 1e-4
) -> None:
    """Each request's `n` greedy tokens are `hf_model`'s (one near-tie allowed), and the chosen
    tokens' logprobs are its teacher-forced ones within `tol`."""
    from tests.checkpoints import hf_greedy, hf_logprobs

    exact = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ours = out.outputs[0].token_ids
        assert len(ours) == n
        exact += assert_greedy_match(hf_model, prompt, ours, hf_greedy(hf_model, prompt, n))
        rows = hf_logprobs(hf_model, prompt, ours)
        for row, tok, lp in zip(rows, ours, out.outputs[0].logprobs, strict=True):
            assert abs(lp[tok] - row[tok].item()) < tol, (len(prompt), tok)
    assert exact >= len(prompts) - 1  # ties are rare: most prompts match exactly
