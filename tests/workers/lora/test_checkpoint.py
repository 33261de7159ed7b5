"""workers/lora/checkpoint.py against adapters written and merged by real peft."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import KINDS, hf_greedy, load_hf
from tests.gemma_checkpoints import make_gemma_checkpoint
from tests.moe_checkpoints import make_moe_checkpoint
from tests.workers.lora.adapters import merged_hf_model, write_random_adapter
from workers.config import ModelConfig
from workers.lora.checkpoint import (
    CONFIG_FILE,
    LORA_MODULES,
    WEIGHTS_FILE,
    LoraAdapter,
    LoraError,
    load_adapter,
)

_BLOCK = {
    n: "self_attn" if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
    for n in LORA_MODULES
}
_PREFIX = "base_model.model.model.layers"


def _weight_name(layer: int, name: str) -> str:
    return f"model.layers.{layer}.{_BLOCK[name]}.{name}.weight"


def _assert_matches_peft(adapter: LoraAdapter, base_dir: Path, adapter_dir: Path) -> None:
    """Every module's scaling * B @ A is what peft's merge added to the base weight."""
    base = load_hf(base_dir).state_dict()
    merged = merged_hf_model(base_dir, adapter_dir).state_dict()
    for (layer, name), module in adapter.modules.items():
        assert module.a.dtype == module.b.dtype == torch.float32
        assert module.a.is_contiguous() and module.b.is_contiguous()
        key = _weight_name(layer, name)
        expected = merged[key] - base[key]
        assert expected.abs().max() > 1e-3, f"{key}: the adapter is a no-op"
        torch.testing.assert_close(module.b @ module.a, expected, atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def configs(checkpoints: dict[str, Path]) -> dict[str, ModelConfig]:
    return {kind: ModelConfig.from_pretrained(path) for kind, path in checkpoints.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_against_peft(
    kind: str, checkpoints: dict[str, Path], configs: dict[str, ModelConfig], tmp_path: Path
) -> None:
    adapter_dir = write_random_adapter(checkpoints[kind], tmp_path / "adapter", seed=3)
    adapter = load_adapter(adapter_dir, configs[kind], max_lora_rank=8)
    model = configs[kind]
    assert set(adapter.modules) == {(i, n) for i in range(model.num_layers) for n in LORA_MODULES}
    assert adapter.rank == 8 and adapter.path == str(adapter_dir)
    assert adapter.nbytes == sum(4 * (m.a.numel() + m.b.numel()) for m in adapter.modules.values())
    # A is peft's lora_A as saved; the scaling (16 / 8) is folded into B.
    saved = load_file(str(adapter_dir / WEIGHTS_FILE))
    q = adapter.modules[(1, "q_proj")]
    assert torch.equal(q.a, saved[f"{_PREFIX}.1.self_attn.q_proj.lora_A.weight"])
    assert torch.equal(q.b, saved[f"{_PREFIX}.1.self_attn.q_proj.lora_B.weight"] * 2.0)
    _assert_matches_peft(adapter, checkpoints[kind], adapter_dir)


def test_random_adapter_changes_greedy_output(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The helper's adapters are far from no-ops: the parity tests built on them can fail."""
    adapter_dir = write_random_adapter(checkpoints["llama"], tmp_path / "adapter")
    prompt = list(range(100, 120))
    base = hf_greedy(checkpoints["llama"], prompt, 8)
    adapted = hf_greedy(merged_hf_model(checkpoints["llama"], adapter_dir), prompt, 8)
    assert sum(x != y for x, y in zip(base, adapted, strict=True)) >= 4, (base, adapted)


def test_gemma3_round_trip(tmp_path: Path) -> None:
    base_dir = make_gemma_checkpoint(
        tmp_path / "gemma", num_layers=2, layer_types=("sliding_attention", "full_attention")
    )
    adapter_dir = write_random_adapter(base_dir, tmp_path / "adapter", rank=4, alpha=4)
    adapter = load_adapter(adapter_dir, ModelConfig.from_pretrained(base_dir), max_lora_rank=4)
    assert len(adapter.modules) == 2 * len(LORA_MODULES)
    _assert_matches_peft(adapter, base_dir, adapter_dir)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"use_rslora": True, "rank": 16, "alpha": 8}, id="rslora"),
        pytest.param(
            {
                "rank": 4,
                "alpha": 8,
                # peft's forms: a module name, a dotted suffix, a regular expression.
                "rank_pattern": {"q_proj": 2, "layers.1.mlp.down_proj": 12},
                "alpha_pattern": {
                    "p_proj": 100,  # matches whole dotted parts only: not up_proj
                    r"model\.layers\.0\.self_attn\.[kv]_proj": 32,
                    "layers.0.mlp.up_proj": 3,  # the first key that matches wins
                    "up_proj": 1,
                },
            },
            id="patterns",
            marks=pytest.mark.filterwarnings("ignore:The following alpha_pattern keys"),
        ),
        pytest.param(
            {"use_rslora": True, "rank_pattern": {"o_proj": 16}, "alpha_pattern": {"o_proj": 2}},
            id="rslora-patterns",
        ),
        pytest.param({"dtype": torch.bfloat16}, id="bf16"),
        pytest.param({"target_modules": ("q_proj", "v_proj")}, id="q-v-only"),
    ],
)
def test_adapter_options_against_peft(
    options: dict[str, Any],
    checkpoints: dict[str, Path],
    configs: dict[str, ModelConfig],
    tmp_path: Path,
) -> None:
    adapter_dir = write_random_adapter(checkpoints["qwen2"], tmp_path / "adapter", **options)
    adapter = load_adapter(adapter_dir, configs["qwen2"], max_lora_rank=16)
    ranks = {key: m.a.shape[0] for key, m in adapter.modules.items()}
    if "rank_pattern" in options and "use_rslora" not in options:
        assert ranks[(0, "q_proj")] == ranks[(1, "q_proj")] == 2
        assert ranks[(1, "down_proj")] == 12 and ranks[(0, "down_proj")] == 4
        assert adapter.rank == 12
    if options.get("dtype") == torch.bfloat16:
        saved = load_file(str(adapter_dir / WEIGHTS_FILE))
        assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    if "target_modules" in options:
        assert {name for _, name in adapter.modules} == {"q_proj", "v_proj"}
    _assert_matches_peft(adapter, checkpoints["qwen2"], adapter_dir)


def test_keys_without_peft_prefix(
    checkpoints: dict[str, Path], configs: dict[str, ModelConfig], tmp_path: Path
) -> None:
    base = checkpoints["mistral"]
    full = load_adapter(write_random_adapter(base, tmp_path / "a", seed=5), configs["mistral"], 8)
    stripped_dir = write_random_adapter(base, tmp_path / "b", seed=5, strip_prefix=True)
    assert not any(k.startswith("base_model") for k in load_file(str(stripped_dir / WEIGHTS_FILE)))
    stripped = load_adapter(stripped_dir, configs["mistral"], 8)
    assert stripped.modules.keys() == full.modules.keys()
    for key, module in full.modules.items():
        assert torch.equal(stripped.modules[key].a, module.a)
        assert torch.equal(stripped.modules[key].b, module.b)


# ---------------------------------------------------------------------------------------------
# Refusals: each names the file and the field.


@pytest.fixture(scope="module")
def good_adapter(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_adapter(checkpoints["llama"], tmp_path_factory.mktemp("good") / "a")


@pytest.fixture
def adapter(good_adapter: Path, tmp_path: Path) -> Path:
    """A fresh copy of a valid llama adapter (rank 8) for a test to break."""
    return Path(shutil.copytree(good_adapter, tmp_path / "adapter"))


def _refused(adapter_dir: Path, model: ModelConfig, *needles: str, max_lora_rank: int = 64) -> None:
    with pytest.raises(LoraError) as info:
        load_adapter(adapter_dir, model, max_lora_rank)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def _edit_config(adapter_dir: Path, **changes: Any) -> None:
    file = adapter_dir / CONFIG_FILE
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def _edit_weights(adapter_dir: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    file = adapter_dir / WEIGHTS_FILE
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"peft_type": "PREFIX_TUNING"}, "peft_type ('PREFIX_TUNING')"),
        ({"peft_type": None}, "peft_type (None)"),
        ({"use_dora": True}, "use_dora (True)"),
        ({"bias": "lora_only"}, "bias ('lora_only')"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save (['lm_head'])"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out (True)"),
        ({"lora_bias": True}, "lora_bias (True)"),
        ({"alora_invocation_tokens": [1, 2]}, "alora_invocation_tokens"),
        ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication"),
        ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights ('pissa_niter_4')"),
        ({"r": 4}, "gives r = 4"),
        ({"r": 0}, "r (0)"),
        ({"lora_alpha": "16"}, "lora_alpha ('16')"),
        ({"rank_pattern": {"q_proj": 4}}, "gives rank_pattern['q_proj'] = 4"),
        ({"rank_pattern": {"q_proj(": 8}}, "rank_pattern key 'q_proj('"),
        ({"alpha_pattern": {"q_proj": None}}, "alpha_pattern"),
    ],
)
def test_config_refused(
    changes: dict[str, Any], field: str, adapter: Path, configs: dict[str, ModelConfig]
) -> None:
    _edit_config(adapter, **changes)
    _refused(adapter, configs["llama"], CONFIG_FILE, field)


def test_rank_over_max_refused(
    adapter: Path, configs: dict[str, ModelConfig], checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    _refused(
        adapter,
        configs["llama"],
        f"{CONFIG_FILE}: r (8) is over max_lora_rank (4)",
        max_lora_rank=4,
    )
    patterned = write_random_adapter(
        checkpoints["llama"], tmp_path / "p", rank=4, rank_pattern={"down_proj": 16}
    )
    _refused(
        patterned,
        configs["llama"],
        CONFIG_FILE,
        "rank_pattern['down_proj'] (16) is over max_lora_rank (8)",
        max_lora_rank=8,
    )


def test_unreadable_files_refused(adapter: Path, configs: dict[str, ModelConfig]) -> None:
    model = configs["llama"]
    _refused(adapter / "nowhere", model, "nowhere", "does not exist")
    weights = (adapter / WEIGHTS_FILE).read_bytes()
    (adapter / WEIGHTS_FILE).write_bytes(weights[: len(weights) // 2])
    _refused(adapter, model, WEIGHTS_FILE, "unreadable")
    (adapter / WEIGHTS_FILE).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    _refused(adapter, model, WEIGHTS_FILE, "unreadable")
    (adapter / WEIGHTS_FILE).rename(adapter / "adapter_model.bin")
    _refused(adapter, model, WEIGHTS_FILE, "adapter_model.bin", "safetensors")
    (adapter / "adapter_model.bin").unlink()
    _refused(adapter, model, WEIGHTS_FILE, "does not exist")
    (adapter / CONFIG_FILE).write_text('{"peft_type": "LORA",')
    _refused(adapter, model, CONFIG_FILE, "unreadable")
    (adapter / CONFIG_FILE).write_text("[1, 2]")
    _refused(adapter, model, CONFIG_FILE, "not a JSON object")
    (adapter / CONFIG_FILE).unlink()
    _refused(adapter, model, CONFIG_FILE, "does not exist")


def _add_pair(prefix: str, a: torch.Tensor, b: torch.Tensor) -> Callable[[dict], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{prefix}.lora_A.weight"] = a
        tensors[f"{prefix}.lora_B.weight"] = b

    return edit


def _set(key: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{_PREFIX}.{key}"] = value(tensors[f"{_PREFIX}.{key}"])

    return edit


_Q_A, _Q_B = "0.self_attn.q_proj.lora_A.weight", "0.self_attn.q_proj.lora_B.weight"
_A, _B = torch.zeros(8, 128), torch.zeros(128, 8)


@pytest.mark.parametrize(
    ("edit", "needles"),
    [
        (_add_pair("base_model.model.lm_head", _A, torch.zeros(4096, 8)), ["lm_head", "LM head"]),
        (_add_pair("base_model.model.model.embed_tokens", _A, _B), ["embed_tokens", "embeddings"]),
        (
            lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A": _A}),
            ["lora_embedding_A", "embeddings"],
        ),
        (_add_pair(f"{_PREFIX}.0.self_attn.rotary", _A, _B), ["no module 'self_attn.rotary'"]),
        (_add_pair(f"{_PREFIX}.0.mlp.q_proj", _A, _B), ["no module 'mlp.q_proj'"]),
        (_add_pair(f"{_PREFIX}.0.mlp.experts.1.gate_proj", _A, _B), ["no module"]),
        (
            _add_pair(f"{_PREFIX}.2.self_attn.q_proj", _A, _B),
            ["layer 2 does not exist", "2 layers"],
        ),
        (lambda t: t.pop(f"{_PREFIX}.{_Q_B}"), [_Q_A, "no lora_B.weight"]),
        (lambda t: t.pop(f"{_PREFIX}.{_Q_A}"), [_Q_B, "no lora_A.weight"]),
        (_set(_Q_A, lambda a: (a * 100).to(torch.int32)), [_Q_A, "torch.int32", "floating"]),
        (_set(_Q_B, lambda b: b.index_fill(0, torch.tensor([3]), float("nan"))), [_Q_B, "NaN"]),
        (
            _set(_Q_A, lambda a: a.index_fill(1, torch.tensor([5]), float("inf"))),
            [_Q_A, "infinite"],
        ),
        (_set(_Q_A, lambda a: a[None]), [_Q_A, "[1, 8, 128]", "not a matrix"]),
        (
            _set(_Q_A, lambda a: a[:, :64].contiguous()),
            ["differs in shape", "[8, 64]", "128 inputs to 128"],
        ),
        (_set(_Q_B, lambda b: b[:, :4].contiguous()), ["q_proj: lora_A has rank 8", "[128, 4]"]),
        (
            lambda t: t.update({f"model.layers.{_Q_A}": t[f"{_PREFIX}.{_Q_A}"].clone()}),
            ["same weight"],
        ),
        (
            lambda t: t.update({"base_model.model.model.layers.0.lora_magnitude_vector": _A}),
            ["lora_magnitude_vector", "not a LoRA weight"],
        ),
        (lambda t: t.clear(), ["holds no LoRA weights"]),
    ],
)
def test_weights_refused(
    edit: Callable[[dict], None],
    needles: list[str],
    adapter: Path,
    configs: dict[str, ModelConfig],
) -> None:
    _edit_weights(adapter, edit)
    _refused(adapter, configs["llama"], WEIGHTS_FILE, *needles)


# peft's own patterns for the fused experts, unused on this model.
@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys")
def test_mixture_of_experts(tmp_path: Path) -> None:
    # Layer 0's MLP is the experts block, layer 1's a dense MLP.
    base_dir = make_moe_checkpoint("qwen3_moe", tmp_path / "moe", mlp_only_layers=(1,))
    model = ModelConfig.from_pretrained(base_dir)
    assert model.moe is not None and model.moe.sparse_layers == (0,)
    # peft turns MLP targets on a MoE model into LoRA on the fused experts' parameters.
    experts_dir = write_random_adapter(base_dir, tmp_path / "experts", rank=4)
    _refused(experts_dir, model, CONFIG_FILE, "target_parameters")
    _edit_config(experts_dir, target_parameters=None)  # its weights are refused too
    _refused(experts_dir, model, WEIGHTS_FILE, "mlp.experts", "layer 0's MLP is a mixture")

    attention = LORA_MODULES[:4]
    adapter_dir = write_random_adapter(base_dir, tmp_path / "adapter", target_modules=attention)
    adapter = load_adapter(adapter_dir, model, max_lora_rank=8)
    assert set(adapter.modules) == {(i, n) for i in range(2) for n in attention}
    _assert_matches_peft(adapter, base_dir, adapter_dir)

    # The dense layer's MLP (which peft does not target on such a model) is served.
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 64, generator=gen), torch.randn(96, 8, generator=gen)
    _edit_weights(adapter_dir, _add_pair(f"{_PREFIX}.1.mlp.up_proj", a, b))
    up = load_adapter(adapter_dir, model, max_lora_rank=8).modules[(1, "up_proj")]
    assert torch.equal(up.a, a) and torch.equal(up.b, b * 2.0)
    for module in ("mlp.gate_proj", "mlp.experts.2.up_proj", "mlp.gate"):
        broken = Path(shutil.copytree(adapter_dir, tmp_path / module))
        _edit_weights(broken, _add_pair(f"{_PREFIX}.0.{module}", a, b))
        _refused(broken, model, WEIGHTS_FILE, module, "layer 0's MLP is a mixture of experts")

    mixtral_dir = make_moe_checkpoint("mixtral", tmp_path / "mixtral")
    broken = Path(shutil.copytree(adapter_dir, tmp_path / "for-mixtral"))
    _edit_weights(broken, lambda t: t.clear())
    _edit_weights(broken, _add_pair(f"{_PREFIX}.1.block_sparse_moe.experts.0.w1", a, b))
    _refused(
        broken,
        ModelConfig.from_pretrained(mixtral_dir),
        WEIGHTS_FILE,
        "block_sparse_moe.experts.0.w1",
        "layer 1's MLP is a mixture of experts",
    )
