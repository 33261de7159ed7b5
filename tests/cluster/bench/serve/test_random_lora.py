"""Random PEFT adapters (cluster/bench/serve/random_lora.py), written without peft: peft itself must
read them as the adapters it would have saved for that model (same keys, shapes, config), and
they must change the model's outputs; kvray's own adapter reader must accept them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cluster.bench.serve.random_lora import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoraShapes,
    write_random_adapter,
    write_random_adapters,
)
from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GQA with head_dim != hidden / heads: every projection has its own shape."""
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))


def test_shapes_come_from_the_config() -> None:
    llama = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 96, "num_hidden_layers": 3}  # fmt: skip
    s = LoraShapes.from_config(llama)
    assert (s.q_out, s.kv_out, s.intermediate, s.layers) == (64, 32, 96, 3)
    assert s.modules()["o_proj"] == ("self_attn", 64, 64)
    assert s.modules()["down_proj"] == ("mlp", 96, 64)
    # An explicit head_dim wins over hidden / heads; no kv heads: as many as heads.
    s = LoraShapes.from_config({**llama, "head_dim": 32, "num_key_value_heads": None})
    assert (s.q_out, s.kv_out) == (128, 128)
    assert s.modules()["o_proj"] == ("self_attn", 128, 64)
    # Mixture of experts: the MLP is the experts, so attention only.
    moe = LoraShapes.from_config({**llama, "num_experts": 8})
    assert list(moe.modules()) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    with pytest.raises(ValueError, match="text-only"):
        LoraShapes.from_config({"text_config": llama})


def test_peft_reads_what_it_would_have_written(qwen3: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    out = write_random_adapter(qwen3, tmp_path / "a", rank=4, seed=1)
    ours = load_file(str(out / WEIGHTS_FILE))
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["bias"] == "none"

    # peft's own adapter for this model and config: the keys and shapes it would save.
    base = AutoModelForCausalLM.from_pretrained(str(qwen3), dtype=torch.float32)
    fresh = get_peft_model(base, LoraConfig.from_pretrained(str(out)))
    theirs = get_peft_model_state_dict(fresh)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {
        k: tuple(v.shape) for k, v in theirs.items()
    }

    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    plain = AutoModelForCausalLM.from_pretrained(str(qwen3), dtype=torch.float32)
    with torch.no_grad():
        want = plain(ids).logits
        loaded = PeftModel.from_pretrained(plain, str(out))
        got = loaded(ids).logits
    # Loaded into the right modules (a key peft did not match would leave B at zero).
    for key, tensor in ours.items():
        name = key.replace(".weight", ".default.weight")
        assert torch.equal(loaded.state_dict()[name], tensor)
    assert not torch.allclose(got, want, atol=1e-4)  # the adapter changes the outputs ...
    assert (got - want).abs().max() < want.abs().max()  # ... without drowning the model


def test_kvray_reads_them_against_the_model(qwen3: Path, tmp_path: Path) -> None:
    from workers.config import ModelConfig
    from workers.lora.checkpoint import LORA_MODULES, load_adapter

    paths = write_random_adapters(qwen3, tmp_path, ["x", "y"], rank=8)
    model = ModelConfig.from_pretrained(str(qwen3))
    adapters = [load_adapter(paths[n], model, max_lora_rank=8) for n in ("x", "y")]
    layers = json.loads((qwen3 / "config.json").read_text())["num_hidden_layers"]
    for a in adapters:
        assert a.rank == 8 and len(a.modules) == layers * len(LORA_MODULES)
    # Seeded one per adapter: two adapters differ, the same call writes the same weights.
    assert not torch.equal(
        adapters[0].modules[(0, "q_proj")].a, adapters[1].modules[(0, "q_proj")].a
    )
    again = write_random_adapter(qwen3, tmp_path / "again", rank=8, seed=0)
    assert (
        load_file(str(again / WEIGHTS_FILE)).keys()
        == load_file(str(paths["x"] / WEIGHTS_FILE)).keys()
    )
    assert all(
        torch.equal(t, load_file(str(paths["x"] / WEIGHTS_FILE))[k])
        for k, t in load_file(str(again / WEIGHTS_FILE)).items()
    )


def test_existing_adapters_are_reused(qwen3: Path, tmp_path: Path) -> None:
    paths = write_random_adapters(qwen3, tmp_path, ["x"], rank=4)
    weights = paths["x"] / WEIGHTS_FILE
    before = weights.stat().st_mtime_ns
    assert write_random_adapters(qwen3, tmp_path, ["x"], rank=4) == paths
    assert weights.stat().st_mtime_ns == before
    # Another rank: rewritten.
    write_random_adapters(qwen3, tmp_path, ["x"], rank=2)
    assert json.loads((paths["x"] / CONFIG_FILE).read_text())["r"] == 2
