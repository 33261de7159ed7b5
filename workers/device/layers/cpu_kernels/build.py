"""The kernel library: compiled from workers/device/layers/csrc/*.c with the system C compiler
into one shared library (cached on disk per source, flags, CPU and compiler), loaded through
ctypes, and probed for what it was built for (vector width, AMX).

`python -m workers.device.layers.cpu_kernels` builds it ahead of time (the Dockerfile
does, so that a replica's first request does not compile) and prints the state the engine
would log.
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
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvray" / "kernels"


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


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


# ctypes signatures: (restype, argtypes) per exported function.
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "paged_decode_attention": (None, [_P] * 7 + [_I] * 8 + [_F]),
    "paged_prefill_attention": (ctypes.c_int, [_P] * 6 + [_I] * 7 + [_F]),
    "skinny_gemm": (None, [_P] * 4 + [_I] * 3),
    "bf16_linear": (ctypes.c_int, [_P] * 4 + [_I] * 4),
    "amx_linear": (ctypes.c_int, [_P] * 4 + [_I] * 4),
    "kvray_amx_enable": (ctypes.c_int, []),
    "rms_norm": (None, [_P] * 3 + [_I] * 5 + [_F]),
    "add_rms_norm": (None, [_P] * 4 + [_I] * 2 + [_F]),
    "silu_and_mul": (None, [_P] * 2 + [_I] * 2),
    "kvray_vector_bytes": (ctypes.c_int, []),
    "rotary": (None, [_P] + [_I] * 3 + [_P] + [_I] * 5 + [_P] * 3),
    "lora_delta": (ctypes.c_int, [_P, _I, _P, _I, _P, _P, _I] + [_P] * 4 + [_I] * 5),
}


def build(march: str = "native") -> ctypes.CDLL | None:
    """The kernel library built for `-march=<march>` (cached on disk), or None when it cannot
    be built. The engine uses `kernel()`, the build for this CPU; another target (`haswell`:
    AVX2 on an AVX-512 host) lets tests run the kernels' narrower register tiles."""
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found: using the torch paths on CPU")
        return None
    sources = sorted(CSRC.glob("*.c"))
    # The headers too: a library built from other headers must not be found in the cache.
    src = b"".join(path.read_bytes() for path in [*sources, *sorted(CSRC.glob("*.h"))])
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
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
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
    (docs/benchmarks.md, "CPUs without AVX-512"), which then keeps them."""
    return lib.kvray_vector_bytes() >= 64


def amx(lib: ctypes.CDLL) -> bool:
    """Whether this process runs bfloat16 weights on the AMX tiles (csrc/amx_linear.c): the
    build targets a CPU with AMX-BF16 and the kernel grants the tile state (asked for here,
    once per process: call it in the process that runs the kernels)."""
    return bool(lib.kvray_amx_enable())


@dataclass(frozen=True)
class KernelState:
    """Whether a worker runs the CPU kernels: `lib` loaded (and what it runs on: `level`), or
    None and the `reason` why not. `str()` is the start-up log line's state, the engine stats'
    `cpu_kernels` and the `cpu_kernels` label of `kvray_engine_info`."""

    lib: ctypes.CDLL | None
    level: str = ""  # "AMX", "AVX-512", "AVX2"
    reason: str = ""  # why off

    @property
    def on(self) -> bool:
        return self.lib is not None

    def __str__(self) -> str:
        return f"on ({self.level})" if self.on else f"off: {self.reason}"

    @staticmethod
    def off(reason: str) -> KernelState:
        return KernelState(None, reason=reason)

    @staticmethod
    def of(lib: ctypes.CDLL | None) -> KernelState:
        """The state of a loaded library (None: no compiler, or its build failed). A build
        narrower than 32-byte vectors is off: then only the norms, rotary and the decode
        kernel would serve and the bfloat16 GEMM and prefill kernel have no tiles."""
        if lib is None:
            return KernelState.off("no C compiler" if _compiler() is None else "build failed")
        if not tiled_kernels(lib):
            return KernelState.off("vectors narrower than 32 bytes")
        if amx(lib):
            return KernelState(lib, "AMX")
        return KernelState(lib, "AVX-512" if wide_vectors(lib) else "AVX2")


def kernel_state(device_type: str, float32: bool, enabled: bool = True) -> KernelState:
    """What a worker on `device_type` with float32 weights (the kernels take float32 only)
    runs: decided once, at its start. `enabled` False: the config turned them off."""
    if device_type != "cpu":
        return KernelState.off("CUDA device" if device_type == "cuda" else f"{device_type} device")
    if not float32:
        return KernelState.off("dtype is not float32")
    if not enabled:
        return KernelState.off("disabled by config")
    return KernelState.of(kernel())


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    state = KernelState.of(kernel())
    print(f"CPU kernels: {state}")


if __name__ == "__main__":
    main()
