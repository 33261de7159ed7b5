"""The Tokenizer wrapper, exercised on the demo checkpoint's real byte-level BPE tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from workers.demo import demo_model_dir
from workers.tokenizer import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TEXTS = [
    "Hello, world! The quick brown fox.",
    "안녕하세요 세계 🌍🚀 kvray 👩‍👩‍👧",
    "def f(x):\n    return x ** 2  # 𝔘ñß 🦀\t\r\n",
    "  leading and trailing spaces  ",
    "",
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return demo_model_dir()


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


def _copy_tokenizer(src: Path, dst: Path, with_generation_config: bool = True) -> Path:
    dst.mkdir()
    names = TOKENIZER_FILES + (("generation_config.json",) if with_generation_config else ())
    for name in names:
        shutil.copy(src / name, dst / name)
    return dst


def _pop_template(directory: Path) -> str:
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    template = config.pop("chat_template")
    path.write_text(json.dumps(config))
    return template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids) == tok.hf.decode(ids, skip_special_tokens=True)


def test_encode_adds_no_special_tokens_like_qwen(tok: Tokenizer) -> None:
    assert tok.encode("hello world") == tok.encode("hello world", add_special_tokens=False)
    assert tok.bos_token_id is not None
    assert tok.encode("hello")[0] != tok.bos_token_id


def test_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>")
    special = [tok.hf.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    eot = tok.hf.convert_tokens_to_ids("<|endoftext|>")
    assert ids[0] == special[0] and ids[-2:] == [special[1], eot]
    assert set(tok.all_special_ids) == {*special, eot}
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|><|endoftext|>"
    )
    assert tok.convert_ids_to_tokens(ids[:1]) == ["<|im_start|>"]


def test_vocab_size_matches_the_model(tok: Tokenizer, model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert tok.vocab_size == len(tok.hf) == config["vocab_size"]


def test_eos_ids_come_from_generation_config(tok: Tokenizer) -> None:
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    eot = tok.hf.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token_ids == (im_end, eot)


def test_eos_ids_without_or_with_scalar_generation_config(model_dir: Path, tmp_path: Path) -> None:
    bare = Tokenizer.from_pretrained(_copy_tokenizer(model_dir, tmp_path / "bare", False))
    im_end = bare.hf.convert_tokens_to_ids("<|im_end|>")
    assert bare.eos_token_ids == (im_end,)

    scalar = _copy_tokenizer(model_dir, tmp_path / "scalar")
    (scalar / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_pretrained(scalar).eos_token_ids == (7, im_end)


def test_chat_template(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    text = tok.render_chat_template(messages)
    assert text == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    without_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[: len(without_prompt)] == without_prompt and len(ids) > len(without_prompt)


def test_missing_chat_template_raises(model_dir: Path, tmp_path: Path) -> None:
    directory = _copy_tokenizer(model_dir, tmp_path / "plain")
    _pop_template(directory)
    tok = Tokenizer.from_pretrained(directory)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="the model has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_beside_the_config(model_dir: Path, tmp_path: Path) -> None:
    directory = _copy_tokenizer(model_dir, tmp_path / "jinja")
    template = _pop_template(directory)
    (directory / "chat_template.jinja").write_text(template)
    tok = Tokenizer.from_pretrained(directory)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
