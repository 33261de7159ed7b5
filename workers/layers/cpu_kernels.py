"""A small C kernel for paged decode attention on CPU, built on first use with the system
C compiler and loaded through ctypes.

Why: the torch-native decode path gathers every sequence's K/V into a padded tensor (a
copy as large as the context, per layer, per step) before attending; on CPU that copy costs
more than the attention itself. The kernel reads K/V in place from the block pool.
If no compiler is available the engine keeps the torch-native path (same results).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("csrc") / "paged_decode_attention.c"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvray" / "kernels"


def _build() -> ctypes.CDLL | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: using the torch-native paged attention on CPU")
        return None
    src = _SRC.read_bytes()
    flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
    key = hashlib.sha256(src + " ".join(flags).encode()).hexdigest()[:16]
    out = _cache_dir() / f"paged_decode_attention-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            proc = subprocess.run(
                [cc, *flags, str(_SRC), "-o", str(tmp_out), "-lm"], capture_output=True, text=True
            )
            if proc.returncode != 0:
                log.warning(
                    "building the CPU attention kernel failed; using torch-native attention:\n%s",
                    proc.stderr[-2000:],
                )
                return None
            os.replace(tmp_out, out)  # atomic: concurrent builders are safe
        log.info("built CPU paged attention kernel: %s", out)
    lib = ctypes.CDLL(str(out))
    lib.paged_decode_attention.restype = None
    lib.paged_decode_attention.argtypes = (
        [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7 + [ctypes.c_float]
    )
    return lib


@functools.lru_cache(maxsize=1)
def kernel() -> ctypes.CDLL | None:
    """The loaded kernel library (built once per process), or None when unavailable."""
    try:
        return _build()
    except Exception:  # noqa: BLE001 - never fatal: the torch path is always there
        log.exception("CPU attention kernel unavailable")
        return None


def paged_decode_attention_cpu(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    d, h, dh = q.shape
    _, bs, kh, _ = k_cache.shape
    max_blocks = tables.shape[1]
    max_len = max_blocks * bs
    q = q.contiguous()
    out = torch.empty_like(q)
    scratch = torch.empty(d * h * max_len, dtype=torch.float32)
    lib.paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        scratch.data_ptr(),
        d,
        h,
        kh,
        dh,
        bs,
        max_blocks,
        max_len,
        scale,
    )
    return out
