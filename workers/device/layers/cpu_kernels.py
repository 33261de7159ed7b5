"""Small C kernels for CPU, built on first use with the system C compiler into one library
and loaded through ctypes (sources in csrc/):
- paged decode attention: the torch-native decode path gathers every sequence's K/V into a
  padded tensor (a copy as large as the context, per layer, per step) before attending; on
  CPU that copy costs more than the attention itself. The kernel reads K/V in place from
  the block pool.
- paged prefill attention: the query tokens of prefill chunks, in blocks that share each
  K/V read, flash-attention style;
- skinny GEMM: linear layers of steps with a few rows (workers/device/layers/linear.py);
- bfloat16-weight GEMM: linear layers whose weights are exactly bfloat16 (a bfloat16
  checkpoint served in float32): half the bytes per step and in memory, the same values;
  on CPUs with AMX (Xeons since Sapphire Rapids) on its tiles instead, with x cut into three
  bfloat16 pieces so that the result keeps float32 accuracy (csrc/amx_linear.c);
- RMSNorm in one pass instead of seven torch ops (workers/device/layers/norm.py);
- rotary embedding of q and k in place, one pass (workers/device/layers/rotary.py);
- SiLU-and-mul of the fused gate/up projection (workers/device/models/llama.py MLP).
`use_cpu_kernels` routes a loaded model's layers through them.
If no compiler is available the engine keeps the torch paths (same results up to float
rounding).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvray" / "kernels"


def _machine(cc: str) -> str:
    """What -march=native builds for: the CPU's feature flags and the compiler. A cache shared
    between hosts (a home directory on NFS, a baked image) must not hand one CPU a library
    built for another: an instruction it lacks kills the process (SIGILL)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):  # x86, ARM
                flags = line
                break
    except OSError:
        pass
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.partition("\n")[0]
    except (OSError, subprocess.SubprocessError):
        version = cc
    return f"{platform.machine()} {flags} {version}"


def library_name(src: bytes, flags: list[str], machine: str) -> str:
    """The cached library's file name: a hash of everything that shapes the build."""
    key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), machine.encode()]))
    return f"kvray-cpu-kernels-{key.hexdigest()[:16]}.so"


def build(march: str = "native") -> ctypes.CDLL | None:
    """The kernel library built for `-march=<march>` (cached on disk), or None when it cannot
    be built. The engine uses `kernel()`, the build for this CPU; another target (`haswell`:
    AVX2 on an AVX-512 host) lets tests run the kernels' narrower register tiles."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: using the torch paths on CPU")
        return None
    sources = sorted(_CSRC.glob("*.c"))
    # The headers too: a library built from other headers must not be found in the cache.
    src = b"".join(path.read_bytes() for path in [*sources, *sorted(_CSRC.glob("*.h"))])
    # -ffast-math only when compiling (vectorised exp, reassociated sums): linked with it,
    # a shared library sets flush-to-zero for the whole process when it loads.
    cflags = ["-O3", f"-march={march}", "-fopenmp", "-fPIC", "-std=c11", "-ffast-math"]
    ldflags = ["-shared", "-fopenmp"]
    out = _cache_dir() / library_name(src, cflags + ldflags, _machine(cc))
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            objs = {path: Path(tmp) / f"{path.stem}.o" for path in sources}
            tmp_out = Path(tmp) / out.name
            compiles = [[cc, *cflags, "-c", str(c), "-o", str(o)] for c, o in objs.items()]
            link = [cc, *ldflags, *map(str, objs.values()), "-o", str(tmp_out), "-lm"]
            for cmd in (*compiles, link):
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    log.warning(
                        "building the CPU kernels failed; using the torch paths:\n%s",
                        proc.stderr[-2000:],
                    )
                    return None
            os.replace(tmp_out, out)  # atomic: concurrent builders are safe
        log.info("built the CPU kernels: %s", out)
    lib = ctypes.CDLL(str(out))
    lib.paged_decode_attention.restype = None
    lib.paged_decode_attention.argtypes = (
        [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 8 + [ctypes.c_float]
    )
    lib.paged_prefill_attention.restype = ctypes.c_int
    lib.paged_prefill_attention.argtypes = (
        [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float]
    )
    lib.skinny_gemm.restype = None
    lib.skinny_gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    lib.bf16_linear.restype = ctypes.c_int
    lib.bf16_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
    lib.amx_linear.restype = ctypes.c_int
    lib.amx_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
    lib.kvray_amx_enable.restype = ctypes.c_int
    lib.kvray_amx_enable.argtypes = []
    lib.rms_norm.restype = None
    lib.rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_float]
    lib.add_rms_norm.restype = None
    lib.add_rms_norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    lib.silu_and_mul.restype = None
    lib.silu_and_mul.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.kvray_vector_bytes.restype = ctypes.c_int
    lib.kvray_vector_bytes.argtypes = []
    lib.rotary.restype = None
    lib.rotary.argtypes = (
        [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] + [ctypes.c_int64] * 5
    ) + [ctypes.c_void_p] * 3
    return lib


@functools.lru_cache(maxsize=1)
def kernel() -> ctypes.CDLL | None:
    """The loaded kernel library (built once per process), or None when unavailable."""
    try:
        return build()
    except Exception:  # noqa: BLE001 - never fatal: the torch path is always there
        log.exception("CPU kernels unavailable")
        return None


def tiled_kernels(lib: ctypes.CDLL) -> bool:
    """Whether `lib` runs its bfloat16-weight GEMM and prefill-attention kernels fast: they
    have register tiles for 32-byte (AVX2) and 64-byte (AVX-512) vectors, none for narrower
    builds (csrc/vector_width.c), where the engine keeps torch's linear and SDPA instead."""
    return lib.kvray_vector_bytes() >= 32


def wide_vectors(lib: ctypes.CDLL) -> bool:
    """Whether `lib` was built for 64-byte vectors (AVX-512). Only then does the skinny GEMM
    serve linear layers with float32 weights: with AVX2 it measured 0.85-1.2x torch's linear
    (README, "CPUs without AVX-512"), which then keeps them."""
    return lib.kvray_vector_bytes() >= 64


def amx(lib: ctypes.CDLL) -> bool:
    """Whether this process runs bfloat16 weights on the AMX tiles (csrc/amx_linear.c): the
    build targets a CPU with AMX-BF16 and the kernel grants the tile state (asked for here,
    once per process: call it in the process that runs the kernels)."""
    return bool(lib.kvray_amx_enable())


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
    threads = max(1, torch.get_num_threads())
    scratch = torch.empty(threads * h * max_len, dtype=torch.float32)
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
        threads,
        scale,
    )
    return out


def paged_prefill_attention_cpu(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    chunks: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """Causal attention of prefill chunks into `out` (contiguous [R, H, Dh], like q):
    chunk c is rows [row0, row0 + n) of q, its first token at position pos0
    (`chunks[c] = (row0, n, pos0)`), reading its sequence's K/V through `tables[row0]`."""
    _, h, dh = q.shape
    _, bs, kh, _ = k_cache.shape
    q = q.contiguous()
    status = lib.paged_prefill_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        chunks.data_ptr(),
        out.data_ptr(),
        chunks.shape[0],
        h,
        kh,
        dh,
        bs,
        tables.shape[1],
        max(1, torch.get_num_threads()),
        scale,
    )
    if status != 0:
        raise RuntimeError(f"paged_prefill_attention failed (head_dim {dh}, or out of memory)")


def _linear_out(x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    """`out` checked to be a contiguous float32 [rows of x, n] to write into, or a new one."""
    if out is None:
        return torch.empty(x.shape[0], n, dtype=x.dtype)
    if out.shape != (x.shape[0], n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} [{x.shape[0]}, {n}]")
    return out


def skinny_linear(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`nn.functional.linear(x, weight, bias)` for a 2-D float32 `x` of a few rows (into
    `out` when given)."""
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = _linear_out(x, n, out)
    lib.skinny_gemm(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        m,
        k,
        n,
    )
    return out


# Output features per panel of the packed bfloat16 weight (NB in csrc/bf16_linear.c, PANEL
# in csrc/amx_linear.c), and k per AMX weight tile (CHUNK).
BF16_PANEL = 32
AMX_CHUNK = 32


def pack_bf16_weight(weight: torch.Tensor, amx: bool = False) -> torch.Tensor | None:
    """`weight` [N, K] (float32) packed for `bf16_linear` (int32 words), or with `amx` for
    `amx_linear` (int16), or None when some value is not a bfloat16 (widening back must give
    every value exactly, or the layer would change).

    A float32 is a bfloat16 exactly when the low 16 bits of its pattern are zero; the high
    16 are then the bfloat16. Layout for csrc/bf16_linear.c: panels of 32 output features,
    each [K][16] int32 words, word j holding feature j's bfloat16 bits in its low half and
    feature 16 + j's in its high half; the last panel zero-padded. For csrc/amx_linear.c:
    N and K zero-padded to multiples of 32; per panel of 32 features, per chunk of 32 k, two
    tiles (features 0-15, 16-31) of [16 pairs of k][16 features][2]."""
    bits = weight.detach().contiguous().view(torch.int32)
    if bool((bits & 0xFFFF).any()):
        return None
    n, k = bits.shape
    panels = -(-n // BF16_PANEL)
    if amx:
        chunks = -(-k // AMX_CHUNK)
        high = bits.view(torch.int16)[:, 1::2]  # little-endian: a float's upper half
        padded = high.new_zeros(panels * BF16_PANEL, chunks * AMX_CHUNK)
        padded[:n, :k] = high
        tiles = padded.view(panels, 2, 16, chunks, AMX_CHUNK // 2, 2)  # p, half, n, c, pair, e
        return tiles.permute(0, 3, 1, 4, 2, 5).contiguous()  # p, c, half, pair, n, e
    if panels * BF16_PANEL != n:
        bits = torch.cat([bits, bits.new_zeros(panels * BF16_PANEL - n, k)])
    halves = bits.view(panels, 2, BF16_PANEL // 2, k)
    # Feature j's high 16 bits moved down (>> is arithmetic: mask), feature 16 + j's as they are.
    words = ((halves[:, 0] >> 16) & 0xFFFF) | halves[:, 1]  # [P, 16, K]
    return words.transpose(1, 2).contiguous()  # [P, K, 16]


def amx_packed(packed: torch.Tensor) -> bool:
    """Whether `packed` is `pack_bf16_weight`'s AMX layout (for csrc/amx_linear.c)."""
    return packed.dtype == torch.int16


def on_amx_tiles(model: torch.nn.Module) -> bool:
    """Whether `use_cpu_kernels` packed some of `model`'s weights for the AMX tiles."""
    packed = (getattr(m, "packed_weight", None) for m in model.modules())
    return any(p is not None and amx_packed(p) for p in packed)


def bf16_linear(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`nn.functional.linear(x, weight, bias)` for a 2-D float32 `x`, with `weight` given by
    `packed = pack_bf16_weight(weight)` (either layout), into `out` when given."""
    x = x.contiguous()
    m, k = x.shape
    out = _linear_out(x, out_features, out)
    gemm = lib.amx_linear if amx_packed(packed) else lib.bf16_linear
    status = gemm(
        x.data_ptr(),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        m,
        k,
        out_features,
        max(1, torch.get_num_threads()),
    )
    check_gemm(status)
    return out


def check_gemm(status: int) -> None:
    """Raises for a failed bfloat16-weight GEMM call (bf16_linear.c or amx_linear.c)."""
    if status == -1:
        raise MemoryError("bfloat16-weight GEMM: no memory for its copy of x")
    if status != 0:  # -2: amx_linear called on a build without AMX (use_cpu_kernels asks first)
        raise RuntimeError(f"bfloat16-weight GEMM failed with status {status}")


def rms_norm_cpu(
    lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm over the last dimension of a float32 `x` (a 3-D view with a dense last
    dimension, like the q/k heads, is read in place; anything else is made contiguous)."""
    if x.dim() == 3 and x.stride(-1) == 1:
        x3 = x
    else:
        x3 = x.contiguous().view(-1, 1, x.shape[-1])
    outer, inner, dim = x3.shape
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.rms_norm(
        x3.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        outer,
        inner,
        x3.stride(0),
        x3.stride(1),
        dim,
        eps,
    )
    return out


def rotary_cpu(
    lib: ctypes.CDLL,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, H, D] and k [T, KH, D] in place (last dim dense) and returns them."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if positions.dtype != torch.int64:  # the kernel reads int64
        positions = positions.to(torch.int64)
    positions = positions.contiguous()
    lib.rotary(
        q.data_ptr(),
        q.shape[1],
        q.stride(0),
        q.stride(1),
        k.data_ptr(),
        k.shape[1],
        k.stride(0),
        k.stride(1),
        q.shape[0],
        q.shape[2],
        cos.data_ptr(),
        sin.data_ptr(),
        positions.data_ptr(),
    )
    return q, k


def silu_and_mul_cpu(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a 2-D float32 [T, 2 * I] fused projection (gate first)."""
    gate_up = gate_up.contiguous()
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
    lib.silu_and_mul(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2)
    return out


def use_cpu_kernels(model: torch.nn.Module, lib: ctypes.CDLL, *, free_float32: bool) -> int:
    """Route a loaded model's layers through `lib`: every module with a `cpu_kernels` slot
    (linear layers and the LM head, norms, rotary, MLP) whose tensors are dense float32.

    Linear layers whose weights are exactly bfloat16 also get a packed bfloat16 copy
    (`packed_weight`), in the AMX tiles' layout where this process may use them (`amx`).
    With `free_float32`, a weight no other module shares (a tied LM head shares the
    embedding's) is then replaced by a shape-only meta tensor and every step of
    the layer reads the copy: half the float32 weight's memory instead of half as much again.
    Without it (the compiled pieces run torch's linear on the float32 weight) both are kept.
    Linear layers take the library where one of its GEMMs is fast: with a packed copy where
    it has the bfloat16 GEMM's tiles (`tiled_kernels`), without one only on AVX-512 builds
    (`wide_vectors`, the skinny GEMM); others keep torch's linear and their float32 weights.
    Returns the bytes of host memory this adds (negative: frees)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                holders[id(param)] = holders.get(id(param), 0) + 1
    added = 0
    tiled, wide = tiled_kernels(lib), wide_vectors(lib)
    on_amx = tiled and amx(lib)  # asks for the tile state in this process: the one that runs
    for module in model.modules():
        if not hasattr(module, "cpu_kernels"):
            continue
        tensors = [*module.parameters(), *module.buffers()]
        if not tensors or not all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
            continue
        if not hasattr(module, "packed_weight"):  # norms, rotary, MLP activation
            module.cpu_kernels = lib
            continue
        weight = module.weight
        packed = pack_bf16_weight(weight, amx=on_amx) if tiled else None
        if packed is None:
            if wide:
                module.cpu_kernels = lib
            continue
        module.cpu_kernels, module.packed_weight = lib, packed
        added += packed.nbytes
        if free_float32 and holders[id(weight)] == 1:
            module.weight = torch.nn.Parameter(
                torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False
            )
            added -= weight.nbytes
    return added
