"""`python -m cluster.bench.step.w8a16`: decode tokens/s of a random-weight model in full
precision against the same model as an int8 weight-only (W8A16, compressed-tensors
int-quantized, per-channel scales) checkpoint, in one run, through `kvray bench step`'s
decode measurement (cluster/bench/step/main.py `measure`).

Three engines, one after the other, the same prompts and settings: the full-precision
checkpoint; the int8 one with its fast path (CPU's int8 GEMM, `torch._weight_int8pack_mm`,
where workers/device/layers/int8_linear.py takes it: bfloat16, steps of at most 16 rows; the
dequantizing reference elsewhere); the int8 one dequantized in every forward (`cpu_kernels`
off). The
int8 checkpoint is written once beside the random model (`<dir>-w8a16`), each projection
quantized per output channel (scale = amax / 127).

    OMP_NUM_THREADS=1 python -m cluster.bench.step.w8a16 --model random:qwen3-100m \\
        --dtype bfloat16 --batch-sizes 1,32
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from statistics import median
from typing import Any

from cluster.bench.common.model_arg import add_model_argument, bench_model_dir
from cluster.bench.step.main import StepSettings, _int_list, measure


def int8_checkpoint(src: Path) -> Path:
    """`src` with every decoder projection stored int8 + a float32 per-channel weight_scale."""
    import torch
    from safetensors.torch import load_file, save_file

    out = src.with_name(src.name + "-w8a16")
    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    packed: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight") and ".layers." in name:
            w = t.float()
            amax = w.abs().amax(dim=1, keepdim=True)
            scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
            packed[name] = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
            packed[name.removesuffix("weight") + "weight_scale"] = scale.contiguous()
        else:
            packed[name] = t
    save_file(packed, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp / "config.json").read_text())
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.bench.step.w8a16", description=__doc__)
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
        "int8 (fast path)": (int8_checkpoint(base), True),
        "int8 (reference)": (int8_checkpoint(base), False),
    }
    results: dict[str, Any] = {}
    for label, (model, kernels) in runs.items():
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
        results[label] = {r.batch: r.batch * 1000 / median(r.step_ms) for r in rows}
    first = next(iter(results.values()))
    print(f"\ndecode tokens/s, {base.name}, {args.dtype} compute, context {args.context}")
    print(f"{'':<20}" + "".join(f"{f'B={b}':>16}" for b in args.batch_sizes))
    for label, per in results.items():
        cells = "".join(f"{per[b]:>9.1f} ({per[b] / first[b]:.2f}x)" for b in args.batch_sizes)
        print(f"{label:<20}{cells}")
    if args.result_json:
        from cluster.bench.common.result import write_result_json

        write_result_json(args.result_json, {"model": str(base), "decode_tokens_per_s": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
