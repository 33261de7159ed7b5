"""The embedding preparation both ingresses share (cluster/ingress/embeddings.py), without Ray:
inputs become pooling requests the engine's own input check accepts; errors name the field."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from cluster.errors import InvalidRequestError, KvrayError
from cluster.ingress import embeddings
from cluster.ingress.embeddings import EmbedInput, EmbedOptions
from cluster.ingress.limits import DEFAULT_LIMITS
from cluster.ingress.prepare import Prepared, Preparer
from cluster.ingress.prompts import Prompts
from workers.inputs import InputChecker
from workers.lora.request import LoRARequest
from workers.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
from workers.pooling import Pooling

MAX_MODEL_LEN = 64


class FakeClient:
    """LLMClient's input_checker, with a short context so limits are cheap to reach."""

    def __init__(self, vocab_size: int, kv_cache_tokens: int | None = None) -> None:
        self.checker = InputChecker(
            vocab_size=vocab_size, max_model_len=MAX_MODEL_LEN, kv_cache_tokens=kv_cache_tokens
        )

    async def input_checker(self) -> InputChecker:
        return self.checker


@pytest.fixture(scope="module")
def prompts(demo_dir: Path) -> Prompts:
    from workers.tokenizer import Tokenizer

    return Prompts(Tokenizer.from_pretrained(demo_dir))


@pytest.fixture(scope="module")
def preparer(prompts: Prompts) -> Preparer:
    return Preparer(prompts, FakeClient(prompts.vocab_size), DEFAULT_LIMITS)


def _http(*values: str | list[int]) -> list[EmbedInput]:
    return [EmbedInput(v, "input", f"input[{i}]") for i, v in enumerate(values)]


def _prepare(
    preparer: Preparer, inputs: list[EmbedInput], options: EmbedOptions = EmbedOptions()
) -> Prepared:
    return asyncio.run(embeddings.prepare(preparer, inputs, options, "input"))


def _invalid(
    preparer: Preparer, inputs: list[EmbedInput], **options: object
) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        _prepare(preparer, inputs, EmbedOptions(**options))  # type: ignore[arg-type]
    return err.value


def test_pooling_defaults_and_names() -> None:
    assert embeddings.pooling(None, None) == Pooling("last", True)
    assert embeddings.pooling("MEAN", False) == Pooling("mean", False)
    with pytest.raises(InvalidRequestError) as err:
        embeddings.pooling("cls", None)
    assert err.value.field == "pooling_type" and "last, mean" in err.value.message
    with pytest.raises(InvalidRequestError) as err:
        embeddings.pooling(None, "yes", normalize_field="normalize")  # type: ignore[arg-type]
    assert err.value.field == "normalize"


def test_each_input_is_one_final_only_pooling_request(preparer: Preparer, prompts: Prompts) -> None:
    prepared = _prepare(preparer, _http("Hello world", [5, 6, 7]), EmbedOptions(Pooling("mean")))
    assert [list(i.prompt_token_ids) for i in prepared.inputs] == [
        list(prompts.tokenizer.encode("Hello world")),
        [5, 6, 7],
    ]
    params = prepared.params
    assert params.pooling == Pooling("mean", True) and params.n == 1
    assert params.output_kind is RequestOutputKind.FINAL_ONLY
    assert prepared.tool_use is None and prepared.constraint is None
    ids = [r.request_id for r in prepared.requests("embd-1")]
    assert ids == ["embd-1-0", "embd-1-1"]
    assert {(i.lora, i.tenant) for i in prepared.inputs} == {(None, None)}
    lora = LoRARequest("a", 3, "/x/a")
    under = asyncio.run(
        embeddings.prepare(
            preparer, _http("Hi", "there"), EmbedOptions(), "input", lora=lora, tenant="t"
        )
    )
    assert {(i.lora, i.tenant) for i in under.inputs} == {(lora, "t")}


def test_empty_batch_empty_input_and_too_many_inputs(preparer: Preparer) -> None:
    assert _invalid(preparer, []).field == "input"
    err = _invalid(preparer, _http("fine", ""))
    assert (err.field, err.message) == ("input", "input[1] must not be empty")
    assert _invalid(preparer, _http("fine", [])).field == "input"
    many = _http(*["x"] * (DEFAULT_LIMITS.max_prompts_per_request + 1))
    err = _invalid(preparer, many)
    assert err.field == "input" and "max_prompts_per_request" in err.message


def test_an_input_over_the_context_names_it_and_the_limit(preparer: Preparer) -> None:
    err = _invalid(preparer, _http([1] * 3, [1] * (MAX_MODEL_LEN + 1)))
    assert err.field == "input"
    assert f"input[1] is {MAX_MODEL_LEN + 1} tokens" in err.message
    assert f"max_model_len {MAX_MODEL_LEN}" in err.message
    assert "truncate_prompt_tokens" in err.message
    # The whole context is the input's: nothing is generated.
    (inp,) = _prepare(preparer, _http([1] * MAX_MODEL_LEN)).inputs
    assert len(inp.prompt_token_ids) == MAX_MODEL_LEN


def test_token_ids_outside_the_vocabulary_name_the_input(
    preparer: Preparer, prompts: Prompts
) -> None:
    err = _invalid(preparer, _http([1, prompts.vocab_size]))
    assert err.field == "input" and "vocabulary" in err.message


def test_truncation_keeps_the_last_tokens(preparer: Preparer) -> None:
    long = list(range(1, MAX_MODEL_LEN + 11))
    (inp,) = _prepare(preparer, _http(long), EmbedOptions(truncate_prompt_tokens=5)).inputs
    assert list(inp.prompt_token_ids) == long[-5:]
    (inp,) = _prepare(preparer, _http(long), EmbedOptions(truncate_prompt_tokens=-1)).inputs
    assert list(inp.prompt_token_ids) == long[-MAX_MODEL_LEN:]
    # Shorter inputs stay whole.
    (inp,) = _prepare(preparer, _http([7, 8]), EmbedOptions(truncate_prompt_tokens=5)).inputs
    assert list(inp.prompt_token_ids) == [7, 8]
    for bad in (0, -2, MAX_MODEL_LEN + 1):
        err = _invalid(preparer, _http([7, 8]), truncate_prompt_tokens=bad)
        assert err.field == "truncate_prompt_tokens" and str(MAX_MODEL_LEN) in err.message


@pytest.mark.parametrize("kv_cache_tokens", [None, MAX_MODEL_LEN // 2, MAX_MODEL_LEN * 2])
def test_longest_input_is_what_the_engines_check_accepts(kv_cache_tokens: int | None) -> None:
    checker = FakeClient(1000, kv_cache_tokens).checker
    params = embeddings.sampling_params(Pooling())
    longest = embeddings.longest_input(checker)
    assert checker.check([1] * longest, params).prompt_token_ids == (1,) * longest
    with pytest.raises(ValueError):
        checker.check([1] * (longest + 1), params)


def test_dimensions_must_be_the_models_size() -> None:
    embeddings.check_dimensions(None, 64)
    embeddings.check_dimensions(64, 64)
    embeddings.check_dimensions(32, None)  # unknown yet: checked on the answer
    for bad in (32, 0):
        with pytest.raises(InvalidRequestError) as err:
            embeddings.check_dimensions(bad, 64)
        assert err.value.field == "dimensions"
    with pytest.raises(InvalidRequestError) as err:
        embeddings.check_dimensions(32, 64)
    assert "(64)" in err.value.message and "cannot" in err.value.message


def test_hidden_size_from_the_checkpoint(demo_dir: Path, tmp_path: Path) -> None:
    expected = json.loads((demo_dir / "config.json").read_text())["hidden_size"]
    assert embeddings.hidden_size(demo_dir) == expected
    assert embeddings.hidden_size(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 8}}))
    assert embeddings.hidden_size(tmp_path) == 8


def test_hidden_size_of_a_gguf_file(tmp_path: Path) -> None:
    from tests.gguf_checkpoints import make_gguf

    assert embeddings.hidden_size(make_gguf(tmp_path / "m.gguf", "qwen3", "Q8_0")) == 256
    (tmp_path / "junk.gguf").write_bytes(b"junk")
    assert embeddings.hidden_size(tmp_path / "junk.gguf") is None


def test_answers_read_the_vector_and_token_count() -> None:
    done = CompletionOutput(0, finish_reason="stop")
    out = RequestOutput("r", None, [1, 2, 3], [done], finished=True, embedding=[0.5, 0.5])
    assert embeddings.embedding_of(out, 0) == [0.5, 0.5]
    assert embeddings.prompt_tokens(out) == 3
    metrics = RequestMetrics(arrival_time=0.0, num_prompt_tokens=4)
    bare = RequestOutput("r", None, [], [done], finished=True, embedding=[1.0], metrics=metrics)
    assert embeddings.prompt_tokens(bare) == 4
    aborted = RequestOutput("r", None, [1], [CompletionOutput(0, finish_reason="abort")], True)
    with pytest.raises(KvrayError) as err:
        embeddings.embedding_of(aborted, 2)
    assert "input 2" in str(err.value) and err.value.http_status == 500
