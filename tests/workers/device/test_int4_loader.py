"""Loading int4 W4A16 checkpoints (compressed-tensors pack-quantized, per group, per channel,
asymmetric per group; workers/device/int4_targets.py): each tensor-parallel rank holds exactly
its slice of every packed weight, its scales and its zero points (checked against the whole
model, Ray-free: a rank's model is built and loaded without its peers), and bad files fail at
load with the tensor named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.int4_checkpoints import W4A16_STRATEGIES, make_w4a16_checkpoint
from tests.workers.loaded_models import float_weight, loaded_model
from workers import LLM
from workers.device.distributed import TPGroup


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int4-loader")
    return {s: make_w4a16_checkpoint(s, root / s) for s in W4A16_STRATEGIES}


@pytest.mark.parametrize("strategy", W4A16_STRATEGIES)
@pytest.mark.parametrize("ranks", [2, 4])
def test_each_rank_holds_its_slice_of_weights_scales_and_zeros(
    strategy: str, ranks: int, checkpoints: dict[str, Path]
) -> None:
    whole = loaded_model(checkpoints[strategy], TPGroup())
    kv = 256 // min(ranks, 2)  # 2 KV heads: replicated beyond 2 ranks
    for rank in range(ranks):
        part = loaded_model(checkpoints[strategy], TPGroup(rank=rank, size=ranks))
        for full, mine in zip(whole.layers, part.layers, strict=True):
            q, k, v = float_weight(full.self_attn.qkv_proj).split([512, 256, 256])
            kv_rank = rank * min(ranks, 2) // ranks
            want = torch.cat(
                [q.chunk(ranks)[rank], k[kv_rank * kv : (kv_rank + 1) * kv], v[kv_rank * kv :][:kv]]
            )
            assert torch.equal(float_weight(mine.self_attn.qkv_proj), want)
            o = float_weight(full.self_attn.o_proj).chunk(ranks, dim=1)[rank]
            assert torch.equal(float_weight(mine.self_attn.o_proj), o)
            gate, up = float_weight(full.mlp.gate_up_proj).chunk(2)
            want = torch.cat([gate.chunk(ranks)[rank], up.chunk(ranks)[rank]])
            assert torch.equal(float_weight(mine.mlp.gate_up_proj), want)
            down = float_weight(full.mlp.down_proj).chunk(ranks, dim=1)[rank]
            assert torch.equal(float_weight(mine.mlp.down_proj), down)
            assert mine.mlp.down_proj.weight_packed.dtype == torch.int32
        if strategy == "group-asym":  # zero points read, not left at the symmetric 8
            assert (part.layers[0].mlp.down_proj.weight_zero != 8).any()


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


def _packed_as_float(t: dict) -> None:
    t[P + ".weight_packed"] = t[P + ".weight_packed"].float()


def _wrong_scales(t: dict) -> None:
    t[P + ".weight_scale"] = torch.ones(256, 1)


def _wrong_shape(t: dict) -> None:
    t[P + ".weight_shape"] = torch.tensor([256, 320])


def _no_zero_point(t: dict) -> None:
    del t[P + ".weight_zero_point"]


def _unpacked(t: dict) -> None:
    del t[P + ".weight_packed"]
    t[P + ".weight"] = torch.zeros(256, 256)


@pytest.mark.parametrize(
    ("kind", "edit", "message"),
    [
        ("group", _packed_as_float, P + r".weight_packed: stored as torch.float32, but an int4"),
        (
            "group",
            _wrong_scales,
            P + r".weight_scale: int4 checkpoint tensor of shape \(256, 1\), expected \(256, 2\)",
        ),
        ("channel", _wrong_shape, P + r".weight_shape: weight_shape \[256, 320\], expected"),
        ("group-asym", _no_zero_point, "missing tensors: " + P + ".weight_zero_point"),
        ("group", _unpacked, "unexpected tensor '" + P + ".weight'"),
    ],
    ids=["packed-dtype", "scale-shape", "weight-shape", "zero-point-missing", "unpacked"],
)
def test_bad_files_fail_at_load_naming_the_tensor(
    kind: str,
    edit,  # noqa: ANN001
    message: str,
    checkpoints: dict[str, Path],
    tmp_path: Path,
) -> None:
    path = _broken(checkpoints[kind], tmp_path / "broken", edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), kv_cache_memory_bytes=4 << 20)


def test_the_targets_refuse_a_shard_that_cuts_a_group_or_a_word_themselves() -> None:
    """Behind ModelConfig's check: a row-parallel rank's columns [64, 128) of 256 cut a
    128-group; columns [4, 8) cut a packed word; asymmetric rows [4, 8) a zero-point word."""
    from workers.device.distributed import TPGroup as Group
    from workers.device.int4_targets import int4_targets
    from workers.device.layers.int4_linear import Int4ColumnParallelLinear, Int4RowParallelLinear
    from workers.device.loader import _Split
    from workers.quantization import QuantizationConfig

    quant = QuantizationConfig(
        method="compressed-tensors", strategy="group", weights="int4", weight_block_size=(1, 128)
    )
    row = Int4RowParallelLinear(64, 256, False, Group(), torch.float32, quant)
    with pytest.raises(
        ValueError,
        match=r"p.weight_scale: tensor_parallel_size \(4\) gives a rank cols \[64, 128\) of "
        r"256, which cuts "
        r"its int4 scale groups of 128 columns",
    ):
        int4_targets("p", row, _Split("cols", 64, 64, 256, 4), None)
    assert set(int4_targets("p", row, _Split("cols", 128, 128, 256, 2), None)) == {
        "p.weight_packed",
        "p.weight_scale",
        "p.weight_shape",
    }
    channel = QuantizationConfig(method="compressed-tensors", strategy="channel", weights="int4")
    narrow = Int4RowParallelLinear(4, 256, False, Group(), torch.float32, channel)
    with pytest.raises(ValueError, match=r"cuts its int4 packed weight words"):
        int4_targets("p", narrow, _Split("cols", 4, 4, 256, 64), None)
    asym = QuantizationConfig(
        method="compressed-tensors", strategy="channel", weights="int4", zero_point=True
    )
    col = Int4ColumnParallelLinear(256, [4], False, Group(), torch.float32, asym)
    with pytest.raises(ValueError, match=r"weight_zero_point: .* cuts its int4 zero points"):
        int4_targets("p", col, _Split("rows", 4, 4, 256, 64), None)
