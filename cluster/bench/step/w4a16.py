"""`python -m cluster.bench.step.w4a16`: decode tokens/s of a random-weight model in full
precision against the same model as an int4 weight-only (W4A16, compressed-tensors
pack-quantized, symmetric, a scale per group of 128 input columns: llm-compressor's W4A16
preset) checkpoint, in one run, through `kvray bench step`'s decode measurement
(cluster/bench/step/main.py `measure`).

Three engines, one after the other, the same prompts and settings: the full-precision
checkpoint; the int4 one with its fast path (CPU's 4-bit GEMM, `torch._weight_int4pack_mm_for_cpu`,
where workers/device/layers/int4_linear.py takes it: bfloat16, steps of at most 32 rows; the
dequantizing reference elsewhere); the int4 one dequantized in every forward (`cpu_kernels`
off). The int4 checkpoint is written once beside the random model (`<dir>-w4a16`).

    OMP_NUM_THREADS=1 python -m cluster.bench.step.w4a16 --model random:qwen3-100m \\
        --batch-sizes 1,32
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

GROUP = 128


def int4_checkpoint(src: Path) -> Path:
    """`src` with every decoder projection packed int4, scale = amax / 7.5 per group (the
    compressed-tensors package's symmetric 4-bit range, -8..7)."""
    import torch
    from safetensors.torch import load_file, save_file

    from workers.device.layers.int4_linear import pack_int4

    out = src.with_name(src.name + "-w4a16")
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
        if not (name.endswith("_proj.weight") and ".layers." in name):
            packed[name] = t
            continue
        rows, cols = t.shape
        g = t.float().reshape(rows, cols // GROUP, GROUP)
        amax = g.abs().amax(-1, keepdim=True)
        scale = torch.where(amax > 0, amax / 7.5, torch.ones_like(amax))
        q = torch.round(g / scale).clamp(-8, 7).reshape(rows, cols) + 8
        prefix = name.removesuffix("weight")
        packed[prefix + "weight_packed"] = pack_int4(q.to(torch.uint8))
        packed[prefix + "weight_scale"] = scale.squeeze(-1).contiguous()
        packed[prefix + "weight_shape"] = torch.tensor([rows, cols])
    save_file(packed, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp / "config.json").read_text())
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": {**weights, "group_size": GROUP}}
        },
        "ignore": ["lm_head"],
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.bench.step.w4a16", description=__doc__)
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
        "int4 (fast path)": (int4_checkpoint(base), True),
        "int4 (reference)": (int4_checkpoint(base), False),
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
