"""The switch and shape of the compiled forward pass (workers/device/compile.py), resolved at the
edge.

Torch-free, like workers/compile_sizes.py, so the engine's config can be built without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.compile_sizes import CPU_COMPILED_MIN_TOKENS, capture_sizes


@dataclass(frozen=True)
class CompilationConfig:
    """The compiled forward pass (workers/device/compile.py)."""

    enabled: bool = False  # torch.compile the pieces around attention
    cuda_graphs: bool = False  # and replay decode-only batches from CUDA graphs (CUDA only)
    capture_sizes: tuple[int, ...] = ()  # decode batch sizes graphs are captured for
    # Steps of fewer tokens run the eager forward: with sleeping OpenMP threads the compiled
    # pieces cost more than they save on small steps (workers/compile_sizes.py). 0: all.
    min_tokens: int = 0
    # Steps that no CUDA graph serves (prefills, mixed steps) run the eager forward: on an
    # H200 the compiled pieces called directly lost to eager (2,048-token prefill steps
    # 0.57x, decode steps without graphs 0.3-0.7x), while decode graphs won
    # (docs/benchmarks.md, "On a GPU (H200)").
    graphs_only: bool = False

    @staticmethod
    def resolve(
        compile: bool | None,
        device_type: str,
        max_num_seqs: int,
        min_tokens: int | None = None,
    ) -> CompilationConfig:
        """`compile` None: on only where it was measured to win, which is nowhere yet: off on
        CPU (docs/benchmarks.md, "Compiled forward on CPU") and on CUDA, where decode steps
        replaying graphs won 2.3-5x on an H200 but a whole benchmark run lost
        (docs/benchmarks.md, "On a GPU (H200)").
        `min_tokens` None: CPU_COMPILED_MIN_TOKENS on CPU; on CUDA only the graphs run
        compiled (`graphs_only`); a number given on CUDA compiles every step from that size."""
        if compile is not None and not isinstance(compile, bool):
            raise ValueError(f"compile must be true, false or null, got {compile!r}")
        if min_tokens is not None and (
            isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0
        ):
            raise ValueError(f"compile_min_tokens must be an int >= 0, got {min_tokens!r}")
        if not compile:
            return CompilationConfig()
        cuda = device_type == "cuda"
        graphs_only = cuda and min_tokens is None
        if min_tokens is None:
            min_tokens = 0 if cuda else CPU_COMPILED_MIN_TOKENS
        sizes = capture_sizes(max_num_seqs) if cuda else ()
        return CompilationConfig(True, cuda, sizes, min_tokens, graphs_only)
