"""Loading FP8 checkpoints (workers/device/loader.py; block-scaled, and compressed-tensors' per
channel, per tensor and per block) and int8 W8A16 ones (per channel, per group): each
tensor-parallel rank holds exactly its slice of every quantized weight and of its scales, all
of them where one spans the split (checked against the whole model, Ray-free: a rank's model is
built and loaded without its peers), and bad files fail at load with the tensor named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.compressed_tensors_checkpoints import (
    INT8_STRATEGIES,
    STRATEGIES,
    make_ct_checkpoint,
    make_int8_checkpoint,
)
from tests.fp8_checkpoints import make_fp8_checkpoint
from tests.workers.loaded_models import float_weight, loaded_model
from workers import LLM
from workers.device.distributed import TPGroup


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8-loader")
    made = {k: make_fp8_checkpoint(k, root / k) for k in ("qwen3", "qwen3_moe")}
    made.update({f"ct-{s}": make_ct_checkpoint(s, root / f"ct-{s}") for s in STRATEGIES})
    made.update({f"i8-{s}": make_int8_checkpoint(s, root / f"i8-{s}") for s in INT8_STRATEGIES})
    return made


def _experts(moe: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return moe.expert_weights(slice(None), torch.float32)


KINDS = ["qwen3", "qwen3_moe", *(f"ct-{s}" for s in STRATEGIES)]


@pytest.mark.parametrize("kind", [*KINDS, *(f"i8-{s}" for s in INT8_STRATEGIES)])
def test_each_rank_holds_its_slice_of_weights_and_scales(
    kind: str, checkpoints: dict[str, Path]
) -> None:
    whole = loaded_model(checkpoints[kind], TPGroup())
    for rank in range(2):
        part = loaded_model(checkpoints[kind], TPGroup(rank=rank, size=2))
        for full, mine in zip(whole.layers, part.layers, strict=True):
            qkv = float_weight(full.self_attn.qkv_proj).split([512, 256, 256])
            want = torch.cat([w.chunk(2)[rank] for w in qkv])
            assert torch.equal(float_weight(mine.self_attn.qkv_proj), want)
            o = float_weight(full.self_attn.o_proj).chunk(2, dim=1)[rank]
            assert torch.equal(float_weight(mine.self_attn.o_proj), o)
            if hasattr(full.mlp, "gate_up_proj"):
                gate, up = float_weight(full.mlp.gate_up_proj).chunk(2)
                want = torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
                assert torch.equal(float_weight(mine.mlp.gate_up_proj), want)
                down = float_weight(full.mlp.down_proj).chunk(2, dim=1)[rank]
                assert torch.equal(float_weight(mine.mlp.down_proj), down)
            else:
                (w13, w2), (m13, m2) = _experts(full.mlp), _experts(mine.mlp)
                gate, up = w13.chunk(2, dim=1)
                want = torch.cat([gate.chunk(2, dim=1)[rank], up.chunk(2, dim=1)[rank]], dim=1)
                assert torch.equal(m13, want)
                assert torch.equal(m2, w2.chunk(2, dim=2)[rank])
                assert mine.mlp.w13.dtype == torch.float8_e4m3fn


def test_a_rank_that_would_cut_a_block_is_refused(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) splits the experts'"):
        loaded_model(checkpoints["qwen3_moe"], TPGroup(rank=0, size=4))


def _broken(src: Path, dst: Path, edit) -> Path:  # noqa: ANN001
    """A copy of checkpoint `src` with its tensors changed by `edit(tensors)`."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


P = "model.layers.1.self_attn.k_proj"


def _wrong_shape(t: dict) -> None:
    t[P + ".weight_scale_inv"] = torch.ones(2, 3)


def _wrong_channel_scales(t: dict) -> None:
    t[P + ".weight_scale"] = torch.ones(256, 2)


def _wrong_group_scales(t: dict) -> None:
    t[P + ".weight_scale"] = torch.ones(256, 1)


def _int8_as_float(t: dict) -> None:
    t[P + ".weight"] = t[P + ".weight"].float()


def _int8_embedding(t: dict) -> None:
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].to(torch.int8)


def _missing_ct_scale(t: dict) -> None:
    del t[P + ".weight_scale"]


def _missing(t: dict) -> None:
    del t[P + ".weight_scale_inv"]


def _unquantized(t: dict) -> None:
    t[P + ".weight"] = t[P + ".weight"].float()


def _fp8_embedding(t: dict) -> None:
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].to(torch.float8_e4m3fn)


def _fp8_router(t: dict) -> None:
    t["model.layers.1.mlp.gate.weight"] = t["model.layers.1.mlp.gate.weight"].to(
        torch.float8_e4m3fn
    )


@pytest.mark.parametrize(
    ("kind", "edit", "message"),
    [
        (
            "qwen3",
            _wrong_shape,
            P + r".weight_scale_inv: FP8 scale grid of shape \(2, 3\), expected \(2, 2\)",
        ),
        ("qwen3", _missing, "missing tensors: " + P + ".weight_scale_inv"),
        ("qwen3", _unquantized, P + r".weight: stored as torch.float32, but an FP8 checkpoint's"),
        (
            "qwen3",
            _fp8_embedding,
            "embed_tokens.weight: stored as torch.float8_e4m3fn, but kvray holds",
        ),
        ("qwen3_moe", _fp8_router, r"mlp.gate.weight: stored as torch.float8_e4m3fn"),
        (
            "ct-channel",
            _wrong_channel_scales,
            P + r".weight_scale: FP8 scale grid of shape \(256, 2\), expected \(256, 1\) "
            r"\(one scale per output channel",
        ),
        ("ct-channel", _missing_ct_scale, "missing tensors: " + P + ".weight_scale"),
        (
            "i8-group",
            _wrong_group_scales,
            P + r".weight_scale: int8 scale grid of shape \(256, 1\), expected \(256, 2\) "
            r"\(one scale per group of 128 columns",
        ),
        (
            "i8-channel",
            _wrong_channel_scales,
            P + r".weight_scale: int8 scale grid of shape \(256, 2\), expected \(256, 1\)",
        ),
        ("i8-channel", _missing_ct_scale, "missing tensors: " + P + ".weight_scale"),
        (
            "i8-channel",
            _int8_as_float,
            P + r".weight: stored as torch.float32, but an int8 \(W8A16\) checkpoint's",
        ),
        ("i8-group", _int8_embedding, "embed_tokens.weight: stored as torch.int8, but kvray holds"),
    ],
    ids=[
        "scale-shape",
        "scale-missing",
        "unquantized-projection",
        "fp8-embedding",
        "fp8-router",
        "ct-scale-shape",
        "ct-scale-missing",
        "int8-group-scale-shape",
        "int8-channel-scale-shape",
        "int8-scale-missing",
        "int8-unquantized-projection",
        "int8-embedding",
    ],
)
def test_bad_files_fail_at_load_naming_the_tensor(
    kind: str,
    edit,
    message: str,
    checkpoints: dict[str, Path],
    tmp_path: Path,  # noqa: ANN001
) -> None:
    path = _broken(checkpoints[kind], tmp_path / "broken", edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), kv_cache_memory_bytes=4 << 20)


def test_the_loader_refuses_a_shard_that_cuts_a_block_itself() -> None:
    """The loader's own check, behind ModelConfig's: a rank's rows [64, 128) of 256."""
    from workers.device.loader import _linear, _Split

    weight, scale = torch.empty(64, 256, dtype=torch.float8_e4m3fn), torch.empty(1, 2)
    _linear("p", weight, None, _Split("rows", 64, 64, 256, 4))  # full precision: any split
    with pytest.raises(ValueError, match=r"p: tensor_parallel_size \(4\) gives a rank rows"):
        _linear("p", weight, scale, _Split("rows", 64, 64, 256, 4))
    assert set(_linear("p", weight, scale, _Split("rows", 128, 128, 256, 2))) == {
        "p.weight",
        "p.weight_scale_inv",
    }


def test_the_loader_refuses_a_shard_that_cuts_a_group_itself() -> None:
    """int8 group scales: a row-parallel rank's columns [64, 128) of 256 cut a 128-group."""
    from workers.device.loader import _linear, _Scales, _Split

    weight, scale = torch.empty(256, 64, dtype=torch.int8), torch.empty(256, 1)
    scales = _Scales(1, 128, "weight_scale", "int8")
    with pytest.raises(
        ValueError,
        match=r"p: tensor_parallel_size \(4\) gives a rank cols \[64, 128\) of 256, "
        r"which cuts its int8 group of 128 columns scales",
    ):
        _linear("p", weight, scale, _Split("cols", 64, 64, 256, 4), scales=scales)
    halves = _linear("p", weight, scale, _Split("cols", 128, 128, 256, 2), scales=scales)
    assert set(halves) == {"p.weight", "p.weight_scale"}
