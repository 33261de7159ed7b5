"""Prompts into token ids at the ingress, with the demo checkpoint's real tokenizer."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from cluster.errors import InvalidRequestError
from cluster.ingress.prompts import OFF_LOOP_CHARS, Prompts, off_loop

CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from workers.demo import demo_model_dir
    from workers.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(demo_model_dir())


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> Prompts:
    return Prompts(tokenizer)


def test_text_and_chat_match_the_tokenizer(prompts: Prompts, tokenizer: Any) -> None:
    assert asyncio.run(prompts.text("Once upon a time")) == tokenizer.encode("Once upon a time")
    want = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert asyncio.run(prompts.chat(CHAT)) == want
    bare = asyncio.run(prompts.chat(CHAT, add_generation_prompt=False))
    assert bare == tokenizer.apply_chat_template(CHAT, add_generation_prompt=False)
    assert len(bare) < len(want)


def test_token_ids_pass_as_they_are(prompts: Prompts) -> None:
    assert asyncio.run(prompts.prompt([5, 6, 7])) == [5, 6, 7]
    assert asyncio.run(prompts.prompt("hi")) == asyncio.run(prompts.text("hi"))


@pytest.mark.parametrize(("prompt", "field"), [("", "prompt"), ([], "prompt"), ("", "text")])
def test_empty_inputs_name_their_field(prompts: Prompts, prompt: Any, field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(prompts.prompt(prompt, field))
    assert err.value.param == field


def test_empty_text_is_fine_where_asked(prompts: Prompts) -> None:
    assert isinstance(asyncio.run(prompts.text("", allow_empty=True)), list)


def test_template_errors_name_the_chat_field(prompts: Prompts) -> None:
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "x"}]

    class NoTemplate:
        def apply_chat_template(self, *_: Any, **__: Any) -> list[int]:
            raise ValueError("the model has no chat template")

    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(Prompts(NoTemplate()).chat(bad, field="chat"))
    assert err.value.param == "chat" and "chat template" in err.value.message


def test_token_ids_outside_the_vocabulary_name_the_field(prompts: Prompts) -> None:
    vocab = prompts.vocab_size
    assert prompts.token_ids([0, vocab - 1], "tokens") == [0, vocab - 1]
    for ids in ([vocab], [-1], [True]):
        with pytest.raises(InvalidRequestError) as err:
            prompts.token_ids(ids, "tokens")
        assert err.value.param == "tokens" and str(vocab) in err.value.message


def test_long_inputs_are_tokenized_off_the_event_loop(prompts: Prompts, tokenizer: Any) -> None:
    def where(_: str) -> str:
        return threading.current_thread().name

    async def run() -> tuple[str, str, str]:
        here = threading.current_thread().name
        small = await off_loop(10, where, "x")
        big = await off_loop(OFF_LOOP_CHARS, where, "x")
        return here, small, big

    here, small, big = asyncio.run(run())
    assert small == here and big != here
    long_text = "word " * (OFF_LOOP_CHARS // 5 + 1)
    assert asyncio.run(prompts.text(long_text)) == tokenizer.encode(long_text)


class _ThreadRecorder:
    """The real tokenizer, noting which thread each encode ran on."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.threads: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return self.tokenizer.encode(text)

    def decode(self, ids: Any) -> str:
        self.threads.append(threading.current_thread().name)
        return self.tokenizer.decode(ids)


def test_a_batch_matches_one_by_one(prompts: Prompts, tokenizer: Any) -> None:
    batch = ["Once upon a time", [5, 6, 7], "The train"]
    got = asyncio.run(prompts.batch(batch))
    assert got == [tokenizer.encode("Once upon a time"), [5, 6, 7], tokenizer.encode("The train")]
    with pytest.raises(InvalidRequestError, match="prompt must not be empty"):
        asyncio.run(prompts.batch(["ok", ""]))


def test_a_batch_long_in_total_is_tokenized_off_the_event_loop(tokenizer: Any) -> None:
    # Each prompt is under OFF_LOOP_CHARS; together they are not.
    recorder = _ThreadRecorder(tokenizer)
    short = "word " * (OFF_LOOP_CHARS // 5 // 4)
    loop_thread = threading.current_thread().name  # asyncio.run runs the loop on this thread
    asyncio.run(Prompts(recorder).batch([short] * 3))
    assert recorder.threads == [loop_thread] * 3  # under the threshold in total: inline
    recorder.threads.clear()
    asyncio.run(Prompts(recorder).batch([short] * 8))
    assert len(recorder.threads) == 8 and loop_thread not in recorder.threads


def test_many_ids_are_decoded_off_the_event_loop(tokenizer: Any) -> None:
    recorder = _ThreadRecorder(tokenizer)
    text = asyncio.run(Prompts(recorder).decode([5, 6, 7] * OFF_LOOP_CHARS))
    assert text == tokenizer.decode([5, 6, 7] * OFF_LOOP_CHARS)
    assert recorder.threads[0] != threading.current_thread().name
