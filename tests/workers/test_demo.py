"""The built-in demo checkpoint: loadable by transformers, varied outputs, cached, deterministic."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest

from workers import demo

PROMPTS = ["Once upon a time", "def fibonacci(n):", "안녕하세요 세계", "The train leaves at"]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.demo_model_dir(tmp_path_factory.mktemp("cache-a"))


@pytest.fixture(scope="module")
def hf_model_and_tokenizer(demo_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # On a shared, oversubscribed CI box several spinning OpenMP threads are many times slower
    # than one for a model this small.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, info = AutoModelForCausalLM.from_pretrained(demo_dir, output_loading_info=True)
    yield model.eval(), AutoTokenizer.from_pretrained(demo_dir), info
    torch.set_num_threads(threads)


def _digests(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def test_layout_and_config(demo_dir: Path) -> None:
    names = {p.name for p in demo_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    } <= names
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["rope_theta"] == 10000.0 and "rope_parameters" not in config
    assert config["tie_word_embeddings"] is True
    tok = json.loads((demo_dir / "tokenizer.json").read_text())
    special = {t["content"]: t["id"] for t in tok["added_tokens"] if t["special"]}
    assert set(special) == set(demo.SPECIAL_TOKENS)
    gen = json.loads((demo_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [special["<|im_end|>"], special["<|endoftext|>"]]
    assert config["eos_token_id"] == special["<|im_end|>"]


def test_transformers_loads_without_missing_keys(hf_model_and_tokenizer) -> None:
    model, tokenizer, info = hf_model_and_tokenizer
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    cfg = model.config
    assert cfg.model_type == "qwen3"
    assert cfg.vocab_size == len(tokenizer)
    assert 3000 <= cfg.vocab_size <= 4096
    assert cfg.rope_parameters["rope_theta"] == 10000.0
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (256, 4, 64)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    # Tied: the LM head is the embedding matrix itself.
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_greedy_outputs_are_diverse(hf_model_and_tokenizer) -> None:
    import torch

    model, tokenizer, _ = hf_model_and_tokenizer
    # One batch without padding: every prompt is cut to the shortest one's token count.
    encoded = [tokenizer.encode(p) for p in PROMPTS]
    width = min(len(ids) for ids in encoded)
    assert width >= 2
    batch = torch.tensor([ids[:width] for ids in encoded])
    with torch.no_grad():
        out = model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            pad_token_id=0,
        )
    continuations = [tuple(row[width:].tolist()) for row in out]
    for prompt, new in zip(PROMPTS, continuations, strict=True):
        assert len(set(new)) >= 10, (prompt, new)
    assert len(set(continuations)) == len(PROMPTS)


def test_chat_template_renders_chatml(hf_model_and_tokenizer) -> None:
    _, tokenizer, _ = hf_model_and_tokenizer
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not plain.endswith("assistant\n")


def test_second_call_uses_the_cache(demo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the cached checkpoint was rebuilt")

    monkeypatch.setattr(demo, "_build", refuse)
    assert demo.demo_model_dir(demo_dir.parent) == demo_dir


def test_concurrent_builds_are_identical_to_the_first(demo_dir: Path, tmp_path: Path) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(demo.demo_model_dir(tmp_path))
        except BaseException as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results[0] == results[1] == tmp_path / demo_dir.name
    # No half-built temporary directories are left behind.
    assert [p.name for p in tmp_path.iterdir()] == [demo_dir.name]
    assert _digests(results[0]) == _digests(demo_dir)


def test_recipe_change_changes_the_cache_key() -> None:
    base = demo.DemoRecipe()
    assert demo.recipe_hash(base) == demo.recipe_hash(demo.DemoRecipe())
    assert demo.recipe_hash(base) != demo.recipe_hash(demo.DemoRecipe(seed=1))
