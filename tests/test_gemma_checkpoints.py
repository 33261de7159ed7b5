"""The Gemma 3 parity checkpoints load cleanly in transformers, with the layers, ropes and
varied outputs they claim."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.checkpoints import hf_greedy
from tests.gemma_checkpoints import GLOBAL_THETA, LOCAL_THETA, make_gemma_checkpoint

S, F = "sliding_attention", "full_attention"


@pytest.mark.parametrize(
    ("spelling", "types"), [("new", [S, F, S, S]), ("old", [S, S, F, S])]
)  # old: sliding_window_pattern 3 over 4 layers
def test_loads_with_every_weight_used(spelling: str, types: list[str], tmp_path: Path) -> None:
    path = make_gemma_checkpoint(tmp_path, spelling=spelling, sharded=True)
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert {k: v for k, v in info.items() if v} == {}
    c = model.config
    assert c.layer_types == types
    assert c.rope_parameters[S] == {"rope_type": "default", "rope_theta": LOCAL_THETA}
    assert c.rope_parameters[F] == {
        "rope_type": "linear",
        "factor": 2.0,
        "rope_theta": GLOBAL_THETA,
    }
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert len(list(path.glob("*.safetensors"))) == 2


def test_greedy_outputs_vary(tmp_path: Path) -> None:
    # A random Gemma easily degenerates into repeating one token; these weights do not.
    model = AutoModelForCausalLM.from_pretrained(
        str(make_gemma_checkpoint(tmp_path)), dtype=torch.float32
    ).eval()
    outs = [hf_greedy(model, [5 + i, 17, 33, 90 + i], 12) for i in range(4)]
    assert len({tuple(o) for o in outs}) == 4
    assert all(len(set(o)) >= 6 for o in outs), outs
