"""A GGUF file's metadata read into kvray's model config (workers/gguf/config.py), held to
transformers' reading of the same file; the in-memory quantization each file gets; and what is
refused at start-up, named."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.gguf_checkpoints import SPECS, make_gguf
from workers.config import EngineArgs, ModelConfig


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_the_model_config_is_transformers_reading_of_the_file(arch: str, tmp_path: Path) -> None:
    from transformers import AutoConfig

    path = make_gguf(tmp_path / f"{arch}.gguf", arch, "Q8_0")
    c = ModelConfig.from_pretrained(path)
    hf = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert c.architecture == type(hf).__name__.replace("Config", "ForCausalLM")
    assert (c.hidden_size, c.num_layers, c.intermediate_size, c.vocab_size) == (
        hf.hidden_size,
        hf.num_hidden_layers,
        hf.intermediate_size,
        hf.vocab_size,
    )
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        head_dim,
    )
    assert c.rms_norm_eps == hf.rms_norm_eps
    assert c.rope.theta == hf.rope_parameters["rope_theta"]
    assert c.max_position_embeddings == hf.max_position_embeddings == 512
    assert c.tie_word_embeddings == hf.tie_word_embeddings == SPECS[arch].tied
    assert c.qkv_bias == SPECS[arch].bias and c.qk_norm == SPECS[arch].qk_norm
    assert c.eos_token_ids == (2,)  # tokenizer.ggml.eos_token_id
    assert c.path == str(path)


def test_q8_0_stays_int8_q4_0_and_q4_k_int4_and_other_types_are_dequantized(tmp_path: Path) -> None:
    q8 = ModelConfig.from_pretrained(make_gguf(tmp_path / "q8.gguf", "llama", "Q8_0"))
    assert q8.quantization is not None
    assert (q8.quantization.weights, q8.quantization.strategy) == ("int8", "group")
    assert (q8.quantization.row_block, q8.quantization.col_block) == (1, 32)
    assert q8.quantization.describe().startswith("gguf (W8A16: int8 weights scaled per group")
    for qtype, offset in (("Q4_0", False), ("Q4_K", True)):  # kept 4-bit, groups of 32
        c = ModelConfig.from_pretrained(make_gguf(tmp_path / f"{qtype}.gguf", "llama", qtype))
        quant = c.quantization
        assert quant is not None and (quant.weights, quant.col_block) == ("int4", 32), qtype
        assert (quant.zero_point, quant.offset) == (False, offset)
    # Q4_0 with Q4_K: both 4-bit, Q4_0 with offsets too.
    both = make_gguf(tmp_path / "q40k.gguf", "llama", "Q4_K", types={"blk.0.attn_q.weight": "Q4_0"})
    quant = ModelConfig.from_pretrained(both).quantization
    assert quant is not None and (quant.weights, quant.offset) == ("int4", True)
    assert quant.describe() == (
        "gguf (W4A16: int4 weights scaled per group of 32 columns with float offsets, "
        "unquantized activations)"
    )
    for qtype in ("Q6_K", "F32"):
        c = ModelConfig.from_pretrained(make_gguf(tmp_path / f"{qtype}.gguf", "llama", qtype))
        assert c.quantization is None and c.checkpoint_dtype == "float32", qtype
    f16 = ModelConfig.from_pretrained(make_gguf(tmp_path / "f16.gguf", "qwen2", "F16"))
    assert f16.quantization is None and f16.checkpoint_dtype == "float16"
    # A Q8_0 file whose llama.cpp mix put one projection in another type: all dequantized.
    mixed = make_gguf(
        tmp_path / "mixed.gguf", "llama", "Q8_0", types={"blk.1.ffn_down.weight": "Q6_K"}
    )
    assert ModelConfig.from_pretrained(mixed).quantization is None
    # Q4_K_M: its Q6_K attn_v has no int4 layer, so every projection is dequantized.
    q4_k_m = make_gguf(tmp_path / "km.gguf", "llama", "Q4_K", types={"blk.0.attn_v.weight": "Q6_K"})
    assert ModelConfig.from_pretrained(q4_k_m).quantization is None


def test_quantization_setting_applies_to_gguf_files(tmp_path: Path) -> None:
    q4 = make_gguf(tmp_path / "q4.gguf", "qwen3", "Q4_K")
    with pytest.raises(ValueError, match=r"quant_method 'gguf'\) and quantization is 'none'"):
        ModelConfig.from_pretrained(q4, "none")
    with pytest.raises(ValueError, match="quantization 'fp8' needs an FP8 checkpoint.*Q4_K"):
        ModelConfig.from_pretrained(q4, "fp8")
    f32 = make_gguf(tmp_path / "f32.gguf", "qwen3", "F32")
    assert ModelConfig.from_pretrained(f32, "none").quantization is None


def test_engine_args_take_a_gguf_file_and_a_tokenizer_directory(tmp_path: Path) -> None:
    path = make_gguf(tmp_path / "m.gguf", "qwen2", "Q4_0", tokenizer=False)
    config = EngineArgs(model=str(path), tokenizer="/some/tokenizer").create_config()
    assert config.model.path == str(path) and config.model.tokenizer == "/some/tokenizer"
    assert config.served_model_name == "m.gguf"
    with pytest.raises(ValueError, match="embeds no tokenizer.*--tokenizer"):
        EngineArgs(model=str(path)).create_config()  # before any worker starts
    own = make_gguf(tmp_path / "own.gguf", "qwen2", "Q4_0")
    assert EngineArgs(model=str(own)).create_config().model.tokenizer is None


def test_linear_rope_scaling_is_read_and_others_refused(tmp_path: Path) -> None:
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    c = ModelConfig.from_pretrained(make_gguf(tmp_path / "lin.gguf", "llama", "F32", metadata=meta))
    assert (c.rope.rope_type, c.rope.factor) == ("linear", 2.0)
    meta = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
    yarn = make_gguf(tmp_path / "yarn.gguf", "llama", "F32", metadata=meta)
    with pytest.raises(ValueError, match="rope.scaling.type 'yarn' is not supported"):
        ModelConfig.from_pretrained(yarn)


def _bare(path: Path, arch: str) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_what_kvray_does_not_serve_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match="unsupported GGUF architecture 'gemma3'.*llama, qwen2, qwen3"
    ):
        ModelConfig.from_pretrained(_bare(tmp_path / "g.gguf", "gemma3"))
    q41 = make_gguf(tmp_path / "q41.gguf", "llama", "Q8_0", types={"blk.0.ffn_up.weight": "Q4_1"})
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_up.weight' has GGUF type Q4_1"):
        ModelConfig.from_pretrained(q41)
    moe = make_gguf(tmp_path / "moe.gguf", "llama", "F32", metadata={"llama.expert_count": 8})
    with pytest.raises(ValueError, match="mixture-of-experts GGUF files are not supported"):
        ModelConfig.from_pretrained(moe)
    noise = {"rope_freqs.weight": np.linspace(1, 8, 32)[::-1].astype(np.float32)}
    l31 = make_gguf(tmp_path / "l31.gguf", "llama", "F32", extra=noise)
    with pytest.raises(ValueError, match="rope_freqs.weight: the RoPE frequency factors do not"):
        ModelConfig.from_pretrained(l31)
    ones = {"rope_freqs.weight": np.ones(32, dtype=np.float32)}
    q2 = make_gguf(tmp_path / "q2.gguf", "qwen2", "F32", extra=ones)
    with pytest.raises(ValueError, match="'rope_freqs.weight' is only read in a llama file"):
        ModelConfig.from_pretrained(q2)
    per_layer = make_gguf(
        tmp_path / "pl.gguf", "llama", "F32", metadata={"llama.attention.head_count_kv": [2, 1]}
    )
    with pytest.raises(ValueError, match=r"per-layer llama.attention.head_count_kv \[2, 1\]"):
        ModelConfig.from_pretrained(per_layer)
    with pytest.raises(ValueError, match="GGUF metadata has no 'llama.embedding_length'"):
        ModelConfig.from_pretrained(_bare(tmp_path / "b.gguf", "llama"), tokenizer="/tok")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        ModelConfig.from_pretrained(tmp_path / "junk.gguf")
    with pytest.raises(ValueError, match="does not exist"):
        ModelConfig.from_pretrained(tmp_path / "missing.gguf")


def test_tensor_parallel_never_cuts_a_q4_group_of_32_columns(tmp_path: Path) -> None:
    import dataclasses

    from workers.quantization import check_quantized_tensor_parallel

    c = ModelConfig.from_pretrained(make_gguf(tmp_path / "q4k.gguf", "llama", "Q4_K"))
    check_quantized_tensor_parallel(c, 2)  # 512 / 2: whole groups
    # 576 = 18 groups: two ranks get 9 each, four would get 4.5.
    wide = dataclasses.replace(c, intermediate_size=576)
    check_quantized_tensor_parallel(wide, 2)
    with pytest.raises(ValueError, match=r"shards of 144, which cut its weight scale groups of 32"):
        check_quantized_tensor_parallel(wide, 4)
