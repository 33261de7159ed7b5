"""Shared by the sampler tests: batch building, a float64 reference for the filters, and a
chi-square check that sampled tokens follow a target distribution."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare

from workers.device.layers.sampler import Sampler, SamplerOutput
from workers.device.layers.sampling_batch import SamplingBatch
from workers.sampling_params import SamplingParams

# A fixed, well-spread distribution over a small vocabulary for the goodness-of-fit tests.
FIT_LOGITS = np.array(
    [2.0, 1.6, 1.3, 1.0, 0.7, 0.4, 0.1, -0.2, -0.6, -1.0, -1.4, -1.9], dtype=np.float32
)
FIT_SAMPLES = 20_000
P_VALUE_FLOOR = 1e-4

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def build(
    params: list[SamplingParams],
    vocab_size: int,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    device: str = "cpu",
    **kwargs: object,
) -> SamplingBatch:
    outputs = outputs if outputs is not None else [[] for _ in params]
    prompts = prompts if prompts is not None else [[] for _ in params]
    return SamplingBatch.build(
        params, prompts, outputs, device=device, vocab_size=vocab_size, **kwargs
    )


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seed: int = 0, **kwargs: object
) -> SamplerOutput:
    return Sampler(seed)(
        logits, build(params, logits.shape[-1], device=str(logits.device), **kwargs)
    )


def reference_keep(
    z: np.ndarray, top_k: int, top_p: float, min_p: float, margin: float = 1e-3
) -> np.ndarray:
    """Which tokens of temperature-scaled logits `z` survive top-k, top-p and min-p, in float64.

    Cuts are by value (a tie with the last survivor survives), so top-p keeps whole groups of
    equal logits. Each rule's margin is checked so that float32 rounding in the sampler cannot
    flip a token in or out.
    """
    z = z.astype(np.float64)
    keep = np.ones(z.shape, dtype=bool)
    if top_k > 0:
        keep &= z >= np.sort(z)[::-1][top_k - 1]

    def renormalised() -> np.ndarray:
        p = np.where(keep, np.exp(z - z.max()), 0.0)
        return p / p.sum()

    if top_p < 1.0:
        p = renormalised()
        groups = np.unique(z[keep])[::-1]  # distinct surviving logits, descending
        group_mass = np.array([p[z == v].sum() for v in groups])
        mass_before = np.cumsum(group_mass) - group_mass
        assert np.min(np.abs(mass_before - top_p)) > margin, "top_p too close to a boundary"
        keep &= z >= groups[mass_before < top_p].min()
    if min_p > 0.0:
        p = renormalised()
        floor = min_p * p.max()
        assert np.min(np.abs(p[keep] - floor)) > margin / 10, "min_p too close to a boundary"
        keep &= p >= floor
    return keep


def target_distribution(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """The distribution the sampler must draw from, in float64."""
    z = logits.astype(np.float64) / temperature
    keep = reference_keep(z, top_k, top_p, min_p)
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    return p / p.sum()


def draw_counts(params: list[SamplingParams], seed: int = 0) -> np.ndarray:
    logits = torch.from_numpy(FIT_LOGITS).expand(len(params), -1).contiguous()
    tokens = sample(logits, params, seed=seed).token_ids
    return np.bincount(tokens.numpy(), minlength=len(FIT_LOGITS))


def assert_fits(counts: np.ndarray, expected: np.ndarray) -> None:
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts}"
    assert (expected[support] * counts.sum() >= 5).all(), "expected cell counts too small"
    fit = chisquare(counts[support], expected[support] * counts.sum())
    assert fit.pvalue > P_VALUE_FLOOR, (fit, counts, expected)
