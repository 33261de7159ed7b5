"""Llama 3.1+ GGUF files' RoPE scaling, recovered from their `rope_freqs.weight`.

llama.cpp's converter does not write a `llama3` rope scaling's parameters to the metadata: it
writes one factor per rotary frequency (each frequency is divided by its factor), computed from
them. The factors follow the llama3 rule: 1 for short wavelengths (below
original / high_freq_factor), `factor` for long ones (above original / low_freq_factor), and
between them 1 / ((1 - s) / factor + s) with s = (original / wavelength - low) / (high - low),
linear in 1 / wavelength. So `factor` is the largest factor, and the band's s values give that
line; (original, low, high) are defined by it only up to a common scale, which changes no
frequency (every use is a ratio of two of them): low_freq_factor is taken as 1, as every
Llama 3.x checkpoint has it. The parameters found must reproduce every factor of the file, or
the file is refused.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

_RTOL = 1e-5  # the file stores float32 factors computed in float64


def _wavelengths(theta: float, head_dim: int) -> np.ndarray:
    return 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def llama3_factors(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: float
) -> np.ndarray:
    """The per-frequency divisors the llama3 rule gives (what `rope_freqs.weight` holds)."""
    wavelen = _wavelengths(theta, head_dim)
    smooth = (original / wavelen - low) / (high - low)
    band = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original / high, 1.0, band)
    return np.where(wavelen > original / low, factor, out)


def llama3_from_factors(
    factors: np.ndarray, theta: float, head_dim: int, where: str
) -> dict[str, Any]:
    """rope_scaling (config.json's spelling) whose llama3 rule gives `factors`; ValueError
    naming `where` when none does."""
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape != (head_dim // 2,):
        raise ValueError(
            f"{where}: {factors.size} factors, expected head_dim / 2 = {head_dim // 2}"
        )
    factor = float(factors.max())
    if np.allclose(factors, 1.0, rtol=_RTOL):
        return {}  # no scaling at all
    band = (factors > 1 + _RTOL) & (factors < factor * (1 - _RTOL))
    found: dict[str, Any] | None = None
    if band.sum() >= 2 and factor > 1:
        s = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / _wavelengths(theta, head_dim)[band], s, 1)
        if intercept < 0 < slope:  # s = (original / wavelength - low) / (high - low), low = 1
            high, original = 1 - 1 / intercept, -slope / intercept
            # Checkpoints' values are round numbers (8192, 4.0): the fit's last bits are noise.
            if abs(original - round(original)) < 1e-3 * original:
                original = round(original)
            if abs(high - round(high, 3)) < 1e-6 * high:
                high = round(high, 3)
            found = {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": float(high),
                "original_max_position_embeddings": original,
            }
    if found is not None:
        want = llama3_factors(theta, head_dim, factor, 1.0, found["high_freq_factor"], original)
        if np.allclose(want, factors, rtol=_RTOL):
            return found
    raise ValueError(
        f"{where}: the RoPE frequency factors do not follow Llama 3's rope scaling (at least two "
        "frequencies between the unscaled and the fully scaled ones are needed to read it)"
    )
