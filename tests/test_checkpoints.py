"""The parity checkpoints load cleanly in transformers and exercise what they claim to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from tests.checkpoints import KINDS, hf_greedy, hf_logprobs, load_hf, make_checkpoint, near_tie

PROMPTS = [[5, 17, 33, 80], [101, 7, 7, 7, 42, 9], [60, 3], [11, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: make_checkpoint(kind, root / kind) for kind in KINDS}


def _file_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def _rope(path: Path) -> dict:
    params = dict(AutoConfig.from_pretrained(str(path)).rope_parameters)
    # transformers keeps the legacy "type" key next to the rope_type it derives from it.
    params.pop("type", None)
    return params


@pytest.mark.parametrize("kind", KINDS)
def test_loads_with_every_weight_used(kind: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[kind]
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}
    assert (
        type(model).__name__ == json.loads((path / "config.json").read_text())["architectures"][0]
    )
    # Every tensor in the files is in the model, bit for bit (norms random, not ones).
    state = model.state_dict()
    for name, tensor in _file_tensors(path).items():
        assert torch.equal(state[name], tensor), name
        if name.endswith("norm.weight"):
            assert not torch.allclose(tensor, torch.ones_like(tensor)), name
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 3_000_000


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_outputs_vary(kind: str, checkpoints: dict[str, Path]) -> None:
    model = load_hf(checkpoints[kind])
    outputs = [hf_greedy(model, prompt, 16) for prompt in PROMPTS]
    assert all(len(out) == 16 for out in outputs)
    assert len({tuple(out) for out in outputs}) == len(PROMPTS)
    assert len({tok for out in outputs for tok in out}) >= 16
    # The oracle's logprobs agree with its own greedy choices.
    rows = hf_logprobs(model, PROMPTS[0], outputs[0])
    assert rows.shape == (16, model.config.vocab_size)
    assert rows.argmax(-1).tolist() == outputs[0]
    assert not any(near_tie(row) for row in rows)
    # ignore_eos semantics: an EOS in the middle neither stops the oracle nor changes it.
    model.generation_config.eos_token_id = outputs[0][2]
    model.config.eos_token_id = outputs[0][2]
    assert hf_greedy(model, PROMPTS[0], 16) == outputs[0]


def test_kind_specific_shapes(checkpoints: dict[str, Path]) -> None:
    tensors = {kind: _file_tensors(path) for kind, path in checkpoints.items()}
    # qwen3: head_dim 48 != hidden/heads, q/k norms over head_dim, tied (no lm_head in files).
    assert tensors["qwen3"]["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 48, 128)
    assert tensors["qwen3"]["model.layers.0.self_attn.k_norm.weight"].shape == (48,)
    assert "lm_head.weight" not in tensors["qwen3"]
    # qwen2: non-zero q/k/v biases.
    for proj in ("q", "k", "v"):
        assert tensors["qwen2"][f"model.layers.1.self_attn.{proj}_proj.bias"].abs().min() > 0
    # GQA (llama) and MQA (mistral).
    assert tensors["llama"]["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 128)
    assert tensors["mistral"]["model.layers.0.self_attn.k_proj.weight"].shape == (32, 128)
    assert "lm_head.weight" in tensors["llama"]


def test_rope_scaling_is_applied(checkpoints: dict[str, Path]) -> None:
    expected = {
        "llama": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64},
        "mistral": {"rope_type": "linear", "factor": 2.0},
        "qwen2": {"rope_type": "default"},
        "qwen3": {"rope_type": "default"},
    }
    for kind, want in expected.items():
        rope = _rope(checkpoints[kind])
        assert {k: rope[k] for k in want} == want, kind
    # Saved by the installed transformers: its spelling on disk (5.x's rope_parameters, 4.x's
    # rope_theta), whatever the kind's.
    v5 = int(transformers.__version__.split(".")[0]) >= 5
    for kind in ("llama", "qwen2"):
        raw = json.loads((checkpoints[kind] / "config.json").read_text())
        assert ("rope_parameters" in raw) is v5 and ("rope_theta" in raw) is not v5
    # The scaled inverse frequencies really differ from plain rope with the same theta.
    model = load_hf(checkpoints["llama"])
    head_dim = 32
    plain = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    assert not torch.allclose(model.model.rotary_emb.inv_freq.float(), plain)


@pytest.mark.parametrize("kind", KINDS)
def test_old_and_new_spelling_agree(kind: str, tmp_path: Path) -> None:
    old = make_checkpoint(kind, tmp_path / "old", config_spelling="old")
    new = make_checkpoint(kind, tmp_path / "new", config_spelling="new")
    assert _rope(old) == _rope(new)
    assert (old / "model.safetensors").read_bytes() == (new / "model.safetensors").read_bytes()


def test_sharded_matches_single_file(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    kind = "qwen2"
    sharded = make_checkpoint(kind, tmp_path / "sharded", sharded=True)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) >= 2 and all((sharded / f).is_file() for f in files)
    assert not (sharded / "model.safetensors").exists()
    model, info = AutoModelForCausalLM.from_pretrained(
        str(sharded), dtype=torch.float32, output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}
    single = load_hf(checkpoints[kind])
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, single(ids).logits)


def test_deterministic_and_seeded(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    again = make_checkpoint("llama", tmp_path / "again")
    reseeded = make_checkpoint("llama", tmp_path / "reseeded", seed=1)
    first = (checkpoints["llama"] / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == first
    assert (reseeded / "model.safetensors").read_bytes() != first
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (again / name).is_file()


def test_unknown_kind_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kind"):
        make_checkpoint("gpt2", tmp_path)
