"""What the weight-only quantization benchmarks share (w8a16.py, w4a16.py): a quantized copy
of a checkpoint written beside it, and the decode tokens/s of full precision, the quantized
fast path and the dequantizing reference, one engine after the other through `kvray bench
step`'s decode measurement (cluster/bench/step/main.py `measure`)."""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

from cluster.bench.common.model_arg import add_model_argument, bench_model_dir
from cluster.bench.step.main import StepSettings, _int_list, measure

if TYPE_CHECKING:
    import torch

# A decoder projection's weight -> the tensors that replace it (names relative to its prefix).
Quantize = Callable[["torch.Tensor"], dict[str, "torch.Tensor"]]


def quantized_checkpoint(
    src: Path, suffix: str, quantize: Quantize, quantization_config: dict[str, Any]
) -> Path:
    """`src` with every decoder projection's weight replaced by `quantize`'s tensors and
    `quantization_config` in its config.json, written once to `<src>-<suffix>`."""
    from safetensors.torch import load_file, save_file

    out = src.with_name(f"{src.name}-{suffix}")
    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors: dict[str, Any] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    packed: dict[str, Any] = {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight") and ".layers." in name:
            prefix = name.removesuffix("weight")
            packed.update({prefix + k: v for k, v in quantize(t).items()})
        else:
            packed[name] = t
    save_file(packed, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(out)
    return out


def run_decode_comparison(
    prog: str, doc: str, label: str, checkpoint: Callable[[Path], Path], argv: list[str] | None
) -> int:
    """The command line of one quantization's benchmark: `label` names its rows."""
    p = argparse.ArgumentParser(prog=prog, description=doc)
    add_model_argument(p)
    p.add_argument("--dtype", default="bfloat16", help="compute dtype (default bfloat16)")
    p.add_argument("--batch-sizes", type=_int_list, default=(1, 32))
    p.add_argument("--context", type=int, default=128, help="prompt tokens per sequence (128)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch (20)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--result-json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    base = bench_model_dir(args.model)
    runs = {
        args.dtype: (base, True),
        f"{label} (fast path)": (checkpoint(base), True),
        f"{label} (reference)": (checkpoint(base), False),
    }
    results: dict[str, Any] = {}
    for name, (model, kernels) in runs.items():
        settings = StepSettings(
            model=str(model),
            batch_sizes=tuple(args.batch_sizes),
            context=args.context,
            prefill_tokens=32,  # `measure` times a prefill too: kept small, not reported
            prefill_steps=1,
            steps=args.steps,
            warmup=args.warmup,
            dtype=args.dtype,
            device="cpu",
            cpu_kernels=kernels,
        )
        rows = [r for r in measure(settings)["rows"] if r.case == "decode"]
        results[name] = {r.batch: r.batch * 1000 / median(r.step_ms) for r in rows}
    first = next(iter(results.values()))
    print(f"\ndecode tokens/s, {base.name}, {args.dtype} compute, context {args.context}")
    print(f"{'':<20}" + "".join(f"{f'B={b}':>16}" for b in args.batch_sizes))
    for name, per in results.items():
        cells = "".join(f"{per[b]:>9.1f} ({per[b] / first[b]:.2f}x)" for b in args.batch_sizes)
        print(f"{name:<20}{cells}")
    if args.result_json:
        from cluster.bench.common.result import write_result_json

        write_result_json(args.result_json, {"model": str(base), "decode_tokens_per_s": results})
    return 0
