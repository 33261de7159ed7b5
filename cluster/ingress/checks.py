"""A request checked once, at the ingress, into the engine's own types.

`sampling_params` builds the engine's SamplingParams (which validates itself) with the
output kind the client's call needs: deltas while it streams, the final output only when it
does not, so the engine builds nothing that would be thrown away; the request's size
bounds (`RequestLimits`: n, stop lists) are checked first. `engine_inputs` checks the
prompts' token ids against the served model (vocabulary, max_model_len with max_tokens)
through the engine's own InputChecker, and gives the EngineInputs as the engine runs them
(the adapter and tenant set). Both raise InvalidRequestError naming the field
(HTTP 400, gRPC INVALID_ARGUMENT) before anything is routed; LLMServer and the engine trust
what they return.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cluster.errors import invalid_from_value_error
from cluster.ingress.limits import DEFAULT_LIMITS, RequestLimits
from workers.inputs import EngineInput, InputChecker
from workers.lora.request import LoRARequest
from workers.outputs import RequestOutputKind
from workers.sampling_params import SamplingParams


def output_kind(stream: bool) -> RequestOutputKind:
    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


def is_streamed(params: SamplingParams) -> bool:
    return params.output_kind is RequestOutputKind.DELTA


def sampling_params(
    kwargs: Mapping[str, Any], *, stream: bool, limits: RequestLimits = DEFAULT_LIMITS
) -> SamplingParams:
    """SamplingParams from an ingress's keyword arguments; a bad value names its field."""
    limits.check_sampling(kwargs)
    try:
        return SamplingParams(**kwargs, output_kind=output_kind(stream))
    except ValueError as err:
        raise invalid_from_value_error(err) from None


def engine_inputs(
    checker: InputChecker,
    token_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    field: str = "prompt",
    priority: int = 0,
    *,
    lora: LoRARequest | None = None,
    tenant: str | None = None,
) -> tuple[EngineInput, ...]:
    """The request's engine inputs, one per prompt (`token_ids`), under the adapter `lora` and
    for `tenant`: what the request asks of all its prompts is checked once, then each prompt.
    InvalidRequestError names `field` for prompt errors (or the parameter, e.g. max_tokens,
    when the parameter is what does not fit)."""
    try:
        request = checker.request(params, priority, lora=lora, tenant=tenant)
        return tuple(request.input(ids, field=field) for ids in token_ids)
    except ValueError as err:
        invalid = invalid_from_value_error(err, default_field=field)
        if invalid.param == "prompt":  # the checker's generic name for the input
            invalid.param = field
        raise invalid from None
