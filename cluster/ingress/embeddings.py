"""Embedding requests prepared for the engine, the same way for HTTP and gRPC.

An embedding request asks the engine to pool its input's final hidden states (after the last
norm, as transformers' `last_hidden_state`) instead of generating: `SamplingParams.pooling`
(workers/pooling.py). Each input is one engine request, prefill only, answered by one
finished RequestOutput whose `embedding` is the vector; both ingresses route them like
generation requests, through the same LLMClient, limits and input check.

Each ingress reads its own request into `EmbedInput`s (only it knows where each input is and
how its errors name it) and `EmbedOptions`; `prepare` then runs the steps every embedding
request takes, each once: batch size, empty inputs, tokenizing, `truncate_prompt_tokens`,
and the engine's input check against the served model. A failure is an InvalidRequestError
naming the field (HTTP 400, gRPC INVALID_ARGUMENT), raised before anything is routed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.errors import InvalidRequestError, KvrayError
from cluster.ingress import checks
from cluster.ingress.prepare import Outputs, Prepared, Preparer
from workers.pooling import POOLING_KINDS, Pooling
from workers.sampling_params import SamplingParams

if TYPE_CHECKING:
    from workers.inputs import CheckedRequest, EngineInput, InputChecker
    from workers.lora.request import LoRARequest
    from workers.outputs import RequestOutput

# The engine ignores max_tokens for a pooling request (1 is the smallest valid value), and
# its input check lets the input fill the whole context.
POOLING_MAX_TOKENS = 1


@dataclass(frozen=True)
class EmbedInput:
    """One input as its ingress read it: text or token ids, and how errors name it."""

    value: str | Sequence[int]
    param: str  # the error's field: HTTP "input", gRPC "inputs[2].text"
    label: str  # the input in error messages: HTTP "input[2]", gRPC "inputs[2].text"


@dataclass(frozen=True)
class EmbedOptions:
    """What the request asks of every input's embedding."""

    pooling: Pooling = Pooling()
    # vLLM's meaning: k keeps the last k tokens of each input, -1 the last as many as the
    # model takes; None: an input over the limit is an error.
    truncate_prompt_tokens: int | None = None
    truncate_field: str = "truncate_prompt_tokens"


def pooling(
    kind: str | None,
    normalize: bool | None,
    kind_field: str = "pooling_type",
    normalize_field: str = "normalize",
) -> Pooling:
    """The request's pooling: last-token and L2-normalised unless it says otherwise.
    `kind` is case-insensitive ("LAST" is how vLLM's pooler config spells it)."""
    name = "last" if kind is None else kind.lower()
    if name not in POOLING_KINDS:
        raise InvalidRequestError(
            kind_field, f"{kind_field} must be one of {', '.join(POOLING_KINDS)}, got {kind!r}"
        )
    if normalize is not None and not isinstance(normalize, bool):
        raise InvalidRequestError(normalize_field, f"{normalize_field} must be a boolean")
    return Pooling(name, True if normalize is None else normalize)  # type: ignore[arg-type]


def sampling_params(p: Pooling) -> SamplingParams:
    """The engine's SamplingParams of an embedding request: its final output only."""
    return checks.sampling_params({"max_tokens": POOLING_MAX_TOKENS, "pooling": p}, stream=False)


def longest_input(checker: InputChecker) -> int:
    """The most tokens one input may have: the context limit the engine's input check
    applies to a pooling request (max_model_len, or the KV cache's capacity for one sequence
    if smaller)."""
    limit = checker.max_model_len
    if checker.kv_cache_tokens is not None:
        limit = min(limit, checker.kv_cache_tokens)
    return limit


def truncated(ids: list[int], keep: int | None, longest: int, field: str) -> list[int]:
    """`ids` after truncate_prompt_tokens (`keep`): its last `keep` tokens, or its last
    `longest` for -1; None leaves it whole."""
    if keep is None:
        return ids
    if keep == -1:
        keep = longest
    elif not 1 <= keep <= longest:
        raise InvalidRequestError(
            field,
            f"{field} must be -1 (the model's limit) or in [1, {longest}], "
            f"the most tokens one input may have; got {keep}",
        )
    return ids[-keep:]


def check_dimensions(dimensions: int | None, size: int | None, field: str = "dimensions") -> None:
    """`dimensions` must be the model's embedding size (its hidden size) when set: the
    vectors are hidden states, and a model not trained for shorter ones (Matryoshka) gives
    meaningless vectors when they are cut. `size` None: not known yet (checked on the
    answer instead)."""
    if dimensions is None:
        return
    if dimensions < 1:
        raise InvalidRequestError(field, f"{field} must be >= 1, got {dimensions}")
    if size is not None and dimensions != size:
        raise InvalidRequestError(
            field,
            f"{field} ({dimensions}) must equal this model's embedding size ({size}): the "
            "model cannot produce shorter embeddings; leave dimensions unset",
        )


def hidden_size(model_dir: str | Path) -> int | None:
    """The checkpoint's hidden size (config.json, or a GGUF file's metadata), which every
    embedding has; None if the checkpoint does not say."""
    from workers.gguf import is_gguf

    try:
        if is_gguf(model_dir):  # the metadata's embedding_length (workers/gguf/config.py)
            from workers.gguf.config import gguf_config

            return int(gguf_config(model_dir)["hidden_size"])
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        # Multimodal checkpoints keep the language model's config under text_config.
        value = cfg.get("hidden_size", (cfg.get("text_config") or {}).get("hidden_size"))
        return int(value) if value is not None else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


async def prepare(
    preparer: Preparer,
    inputs: Sequence[EmbedInput],
    options: EmbedOptions,
    batch_field: str,
    *,
    lora: LoRARequest | None = None,
    tenant: str | None = None,
) -> Prepared:
    """The engine requests of an embedding request, one per input, checked (module doc),
    under the adapter `lora` and for `tenant`."""
    if not inputs:
        raise InvalidRequestError(batch_field, f"{batch_field} must hold at least one input")
    preparer.limits.check_prompts(len(inputs), batch_field)
    for inp in inputs:
        if not inp.value:
            raise InvalidRequestError(inp.param, f"{inp.label} must not be empty")
    params = sampling_params(options.pooling)
    ids = await preparer.prompts.batch([inp.value for inp in inputs], batch_field)
    checker = await preparer.client.input_checker()
    longest = longest_input(checker)
    # What every input shares is checked once (the params are the ingress's own), each input next.
    request = checker.request(params, lora=lora, tenant=tenant)
    checked = tuple(
        engine_input(
            request,
            truncated(x, options.truncate_prompt_tokens, longest, options.truncate_field),
            inp,
        )
        for x, inp in zip(ids, inputs, strict=True)
    )
    return Prepared(params, checked, Outputs(tool_use=None, constraint=None))


def engine_input(request: CheckedRequest, ids: list[int], inp: EmbedInput) -> EngineInput:
    """The checked input; every error of the check is about the input (the params are the
    ingress's own), so it names the input's field."""
    checker = request.checker
    longest = longest_input(checker)
    if len(ids) > longest:  # said here with the way out (truncate_prompt_tokens)
        mml = checker.max_model_len
        named = f"max_model_len {mml}" if longest == mml else "the KV cache's capacity"
        raise InvalidRequestError(
            inp.param,
            f"{inp.label} is {len(ids)} tokens, over the {longest} tokens one input may have "
            f"({named}); shorten it, or set truncate_prompt_tokens to keep its last tokens",
        )
    try:
        return request.input(ids, field=inp.label)
    except ValueError as err:
        raise InvalidRequestError(inp.param, str(err)) from None


def embedding_of(out: RequestOutput, index: int) -> list[float]:
    """The vector of a finished pooling request; a missing one is the server's fault."""
    if out.embedding is None:
        reason = out.outputs[0].finish_reason if out.outputs else None
        raise KvrayError(f"the engine returned no embedding for input {index} ({reason})")
    return out.embedding


def prompt_tokens(out: RequestOutput) -> int:
    """Tokens the engine pooled for one input (the API's usage)."""
    if out.prompt_token_ids:
        return len(out.prompt_token_ids)
    return out.metrics.num_prompt_tokens if out.metrics is not None else 0
