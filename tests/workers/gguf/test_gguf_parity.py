"""GGUF files served by the engine: greedy tokens and their logprobs identical, in float32, to
transformers' own loading of the same file (gguf-py dequantizes it there; kvray dequantizes with
its own code, workers/gguf/dequant.py), for each of Q8_0, Q4_0, Q4_K and Q6_K over Llama (its
Q/K rows permuted in the file), Qwen2 (biases) and Qwen3 (q/k norms, tied embeddings). Q8_0
projections stay int8 in memory, Q4_0 and Q4_K ones 4-bit (int4 W4A16, Q4_K with float
offsets); the tokenizer comes from the file, or from --tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.gguf_checkpoints import load_hf_gguf, make_gguf
from tests.workers.parity import assert_greedy_and_logprobs_match
from workers import LLM, SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
LENGTHS = [1, 5, 17, 40]
# (file type, architecture): every type once, Llama's permuted Q/K under two of them.
CASES = [("Q8_0", "llama"), ("Q4_0", "qwen2"), ("Q4_K", "llama"), ("Q6_K", "qwen3")]
CASES += [("F16", "qwen2"), ("BF16", "llama")]  # float files: cast to float32 at load
# llama.cpp's mixes: Q4_K_M keeps attn_v, ffn_down and the head in Q6_K; a Q8_0 file may
# carry its embeddings in another type (the projections stay int8).
CASES += [("Q4_K_M", "llama"), ("Q8_0+Q6_K", "qwen3")]
_MIXES = {
    "Q4_K_M": (
        "Q4_K",
        {f"blk.{i}.{p}.weight": "Q6_K" for i in (0, 1) for p in ("attn_v", "ffn_down")}
        | {"output.weight": "Q6_K"},
    ),
    "Q8_0+Q6_K": ("Q8_0", {"token_embd.weight": "Q6_K"}),
}


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 3800) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize(("qtype", "arch"), CASES)
def test_greedy_and_logprobs_match_transformers(qtype: str, arch: str, tmp_path: Path) -> None:
    file_type, types = _MIXES.get(qtype, (qtype, {}))
    path = make_gguf(tmp_path / f"{arch}-{qtype}.gguf", arch, file_type, types=types)
    prompts = _prompts()
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20)
    try:
        config = llm.engine.config.model
        assert config.architecture.lower().startswith(arch)
        layer = llm.engine.executor.worker.model.layers[0]
        proj = layer.self_attn.qkv_proj
        quant = config.quantization
        if file_type == "Q8_0":  # kept int8 with a scale per 32 columns
            assert quant is not None and quant.method == "gguf"
            assert proj.weight.dtype == torch.int8
        elif qtype in ("Q4_0", "Q4_K"):  # kept 4-bit: eight values an int32, a scale per 32
            assert quant is not None and (quant.method, quant.weights) == ("gguf", "int4")
            for p in (proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                assert p.weight_packed.dtype == torch.int32 and not hasattr(p, "weight")
                assert (p.weight_offset is not None) == (qtype == "Q4_K")
                assert p.weight_scale.shape[1] * 32 == p.in_features
        else:  # dequantized (or cast) into the compute dtype at load
            assert config.quantization is None and proj.weight.dtype == torch.float32
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    hf = load_hf_gguf(path)
    assert_greedy_and_logprobs_match(hf, prompts, outs, MAX_TOKENS)
    # Not a degenerate model: the continuations differ from one another.
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


def test_tokenizer_from_the_file_encodes_as_the_source_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from workers.demo import demo_model_dir

    path = make_gguf(tmp_path / "tok.gguf", "qwen3", "Q8_0")
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20)
    try:
        ours = llm.engine.tokenizer
    finally:
        llm.engine.shutdown()
    source = AutoTokenizer.from_pretrained(str(demo_model_dir()))
    text = "The quick brown fox, naïvely: 12 + 30 = 42.\n<|im_start|>user"
    assert ours.encode(text) == source.encode(text)
    assert ours.decode(source.encode(text), skip_special_tokens=False) == text
    assert ours.has_chat_template
    assert 2 in ours.eos_token_ids  # the file's tokenizer.ggml.eos_token_id (<|im_end|>)


def test_a_file_without_a_tokenizer_needs_one_named(tmp_path: Path) -> None:
    from workers.demo import demo_model_dir

    path = make_gguf(tmp_path / "bare.gguf", "llama", "Q4_0", tokenizer=False)
    with pytest.raises(ValueError, match="embeds no tokenizer.*--tokenizer"):
        LLM(str(path), kv_cache_memory_bytes=16 << 20)
    llm = LLM(str(path), tokenizer=str(demo_model_dir()), kv_cache_memory_bytes=16 << 20)
    try:
        out = llm.generate(["Hello there"], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 3
        assert llm.engine.tokenizer.encode("Hello there") == out[0].prompt_token_ids
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral"])
def test_a_converted_checkpoint_serves_as_the_checkpoint_does(kind: str, tmp_path: Path) -> None:
    """A Hugging Face checkpoint converted to a float32 GGUF file as llama.cpp converts it:
    the tokens transformers gives on the original checkpoint (Qwen3's head_dim 48 != hidden /
    heads, read from attention.key_length; Mistral's linear rope from rope.scaling.*;
    Mistral's Q/K permuted as a `llama` file's)."""
    from tests.checkpoints import load_hf, make_checkpoint
    from tests.gguf_checkpoints import hf_to_gguf

    hf_dir = make_checkpoint(kind, tmp_path / "hf")
    path = hf_to_gguf(hf_dir, tmp_path / f"{kind}.gguf")
    prompts = _prompts()
    llm = LLM(str(path), kv_cache_memory_bytes=16 << 20)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert_greedy_and_logprobs_match(load_hf(hf_dir), prompts, outs, MAX_TOKENS)
