"""GGUF tensors into kvray's modules (workers/gguf/tensors.py through the loader): names,
Llama's Q/K rows back in Hugging Face's order, every weight kvray holds equal to transformers'
weight from the same file, Q8_0 kept int8, and each tensor-parallel rank's shard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gguf_checkpoints import llama_cpp_permute, load_hf_gguf, make_gguf
from tests.workers.loaded_models import float_weight, loaded_model
from workers.device.distributed import TPGroup
from workers.gguf.tensors import hf_name, unpermute


def test_names_map_to_hugging_face_checkpoint_names() -> None:
    assert hf_name("token_embd.weight") == ("model.embed_tokens.weight", "token_embd")
    assert hf_name("output.weight") == ("lm_head.weight", "output")
    assert hf_name("output_norm.weight") == ("model.norm.weight", "output_norm")
    assert hf_name("blk.11.attn_k.bias") == ("model.layers.11.self_attn.k_proj.bias", "attn_k")
    assert hf_name("blk.0.attn_output.weight")[0] == "model.layers.0.self_attn.o_proj.weight"
    assert hf_name("blk.3.ffn_norm.weight")[0] == "model.layers.3.post_attention_layernorm.weight"
    assert hf_name("blk.2.attn_q_norm.weight")[0] == "model.layers.2.self_attn.q_norm.weight"
    for bad in ("blk.0.ffn_gate_exps.weight", "token_embd", "blk.0.output.weight", "x.weight"):
        with pytest.raises(ValueError, match="unexpected tensor"):
            hf_name(bad)


@pytest.mark.parametrize("shape", [(4 * 8, 16), (4 * 8,), (2 * 128, 3)])
def test_unpermute_undoes_llama_cpp_permutation(shape: tuple[int, ...]) -> None:
    import numpy as np

    heads = 4 if shape[0] == 32 else 2
    w = torch.randn(shape)
    stored = torch.from_numpy(llama_cpp_permute(w.numpy(), heads).copy())
    assert not torch.equal(stored, w)
    assert torch.equal(unpermute(stored, heads), w)
    # One head's rows: GGUF keeps each rotated pair (j, j + head_dim / 2) adjacent.
    hd = shape[0] // heads
    assert np.array_equal(stored[1].numpy(), w[hd // 2].numpy())


@pytest.mark.parametrize(
    ("arch", "qtype"), [("llama", "Q8_0"), ("llama", "Q4_K"), ("qwen2", "Q4_0"), ("qwen3", "Q6_K")]
)
def test_every_weight_is_transformers_weight(arch: str, qtype: str, tmp_path: Path) -> None:
    path = make_gguf(tmp_path / f"{arch}.gguf", arch, qtype)
    ours, hf = loaded_model(path, TPGroup()), load_hf_gguf(path).model
    assert torch.equal(
        ours.embed_tokens.weight[: hf.embed_tokens.weight.shape[0]], hf.embed_tokens.weight
    )
    assert torch.equal(ours.norm.weight, hf.norm.weight)
    for mine, ref in zip(ours.layers, hf.layers, strict=True):
        a, r = mine.self_attn, ref.self_attn
        qkv = torch.cat([r.q_proj.weight, r.k_proj.weight, r.v_proj.weight])
        assert torch.equal(float_weight(a.qkv_proj), qkv)
        assert torch.equal(float_weight(a.o_proj), r.o_proj.weight)
        if r.q_proj.bias is not None:
            assert torch.equal(
                a.qkv_proj.bias, torch.cat([r.q_proj.bias, r.k_proj.bias, r.v_proj.bias])
            )
        if a.q_norm is not None:
            assert torch.equal(a.q_norm.weight, r.q_norm.weight)
            assert torch.equal(a.k_norm.weight, r.k_norm.weight)
        gate_up = torch.cat([ref.mlp.gate_proj.weight, ref.mlp.up_proj.weight])
        assert torch.equal(float_weight(mine.mlp.gate_up_proj), gate_up)
        assert torch.equal(float_weight(mine.mlp.down_proj), ref.mlp.down_proj.weight)
        assert torch.equal(mine.input_layernorm.weight, ref.input_layernorm.weight)
        assert torch.equal(
            mine.post_attention_layernorm.weight, ref.post_attention_layernorm.weight
        )
        held = _held(a.qkv_proj)
        assert held == {"Q8_0": torch.int8, "Q4_K": torch.int32, "Q4_0": torch.int32}.get(
            qtype, torch.float32
        )


def _held(module: torch.nn.Module) -> torch.dtype:
    """The dtype a projection's weights are held in (int32: packed int4)."""
    return module.weight_packed.dtype if hasattr(module, "weight_packed") else module.weight.dtype


@pytest.mark.parametrize(("qtype", "held"), [("Q8_0", torch.int8), ("Q4_K", torch.int32)])
def test_each_rank_holds_its_slice_of_quantized_weights_and_scales(
    qtype: str, held: torch.dtype, tmp_path: Path
) -> None:
    path = make_gguf(tmp_path / "llama.gguf", "llama", qtype)
    whole = loaded_model(path, TPGroup())
    for rank in range(2):
        part = loaded_model(path, TPGroup(rank=rank, size=2))
        for full, mine in zip(whole.layers, part.layers, strict=True):
            assert _held(mine.self_attn.qkv_proj) == _held(mine.mlp.down_proj) == held
            qkv = float_weight(full.self_attn.qkv_proj).split([256, 128, 128])
            want = torch.cat([w.chunk(2)[rank] for w in qkv])
            assert torch.equal(float_weight(mine.self_attn.qkv_proj), want)
            o = float_weight(full.self_attn.o_proj).chunk(2, dim=1)[rank]
            assert torch.equal(float_weight(mine.self_attn.o_proj), o)
            gate, up = float_weight(full.mlp.gate_up_proj).chunk(2)
            want = torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
            assert torch.equal(float_weight(mine.mlp.gate_up_proj), want)
            down = float_weight(full.mlp.down_proj).chunk(2, dim=1)[rank]
            assert torch.equal(float_weight(mine.mlp.down_proj), down)


def test_a_tensor_not_in_the_model_is_refused_by_name(tmp_path: Path) -> None:
    import numpy as np

    extra = {"blk.0.ffn_gate_inp.weight": np.zeros((4, 256), dtype=np.float32)}
    path = make_gguf(tmp_path / "x.gguf", "qwen2", "Q4_0", extra=extra)
    with pytest.raises(ValueError, match="unexpected tensor 'blk.0.ffn_gate_inp.weight'"):
        loaded_model(path, TPGroup())
