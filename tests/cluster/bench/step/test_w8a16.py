"""`python -m cluster.bench.step.w8a16` on the demo model: the int8 checkpoint it writes holds
int8 projections with per-channel scales, and one run measures all three engines."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from cluster.bench.step.w8a16 import int8_checkpoint, main


def test_the_int8_checkpoint_and_a_run_of_the_three_engines(demo_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "demo"
    src.mkdir()
    for f in demo_dir.iterdir():
        (src / f.name).symlink_to(f)
    out = int8_checkpoint(src)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        s = f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale")
    assert str(w.dtype) == "torch.int8" and tuple(s.shape) == (w.shape[0], 1)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == (
        "int-quantized"
    )
    result = tmp_path / "r.json"
    argv = ["--model", str(src), "--batch-sizes", "1", "--steps", "1", "--warmup", "0"]
    assert main([*argv, "--context", "8", "--result-json", str(result)]) == 0
    rates = json.loads(result.read_text())["decode_tokens_per_s"]
    assert len(rates) == 3 and all(r["1"] > 0 for r in rates.values())
