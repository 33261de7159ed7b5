"""What each finished request of `kvray bench serve --chaos` should have answered, and whether
it did.

Greedy and seeded sampling do not depend on batching, on the replica or on a migration
(docs/failover.md), so the offline engine (`workers.LLM`, the same checkpoint, in this
process) gives the one right answer for each request: the same text, finish reason and
number of tokens. A structured request that finished by its grammar ("stop") must also be
JSON that validates against its schema. Anything else is a changed output.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cluster.bench.chaos.client import ChaosResult
from cluster.bench.chaos.workload import ChaosRequest

# The offline engine's KV cache: plenty for a batch of the workload's requests.
KV_CACHE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Expected:
    text: str
    finish_reason: str | None
    completion_tokens: int


def offline_params(req: ChaosRequest) -> Any:
    """The request's SamplingParams, as the ingress builds them from its HTTP body."""
    from workers import SamplingParams

    kwargs: dict[str, Any] = {"max_tokens": req.max_tokens, **req.sampling}
    if req.structured:
        from workers.structured import StructuredOutputs

        kwargs["structured_outputs"] = StructuredOutputs.from_schema(req.schema_dict())
    else:
        kwargs["ignore_eos"] = True
    return SamplingParams(**kwargs)


def expected_outputs(
    model_dir: str, requests: Sequence[ChaosRequest], threads: int = 1, alone: bool = False
) -> list[Expected]:
    """The offline engine's answer to each request, in order: all in one batch, or each
    `alone` (a batch of its own: where a served output differs from the batch's answer, this
    tells whether the engine's own numerics depend on the batch). `threads`: torch threads (1
    is what a CPU replica with one reserved CPU runs); 0 leaves torch's default."""
    if not requests:
        return []
    if threads:
        import torch

        torch.set_num_threads(threads)
    from workers import LLM

    llm = LLM(model=model_dir, kv_cache_memory_bytes=KV_CACHE_BYTES)
    try:
        prompts = [
            list(r.prompt_ids)
            if r.api == "completions"
            else llm.tokenizer.apply_chat_template(r.messages(), add_generation_prompt=True)
            for r in requests
        ]
        params = [offline_params(r) for r in requests]
        if alone:
            outs = [
                llm.generate([p], [q], use_tqdm=False)[0]
                for p, q in zip(prompts, params, strict=True)
            ]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [
        Expected(o.outputs[0].text, o.outputs[0].finish_reason, len(o.outputs[0].token_ids))
        for o in outs
    ]


def schema_problem(text: str, schema: dict[str, Any]) -> str:
    """Why `text` is not a JSON document valid against `schema` ("" when it is)."""
    import jsonschema

    try:
        doc = json.loads(text)
    except ValueError as err:
        return f"not JSON ({err})"
    try:
        jsonschema.validate(doc, schema)
    except jsonschema.ValidationError as err:
        return f"does not validate: {err.message}"
    return ""


def changes(res: ChaosResult, want: Expected) -> list[str]:
    """How a finished request's answer differs from the offline engine's ([]: it does not)."""
    out = []
    if res.text != want.text:
        i = _first_diff(res.text, want.text)
        served, offline = res.text[i : i + 16], want.text[i : i + 16]
        out.append(f"text differs from char {i}: served {served!r}, offline {offline!r}")
    if res.finish_reason != want.finish_reason:
        out.append(f"finish_reason {res.finish_reason}, offline {want.finish_reason}")
    if res.completion_tokens != want.completion_tokens:
        out.append(f"{res.completion_tokens} completion tokens, offline {want.completion_tokens}")
    schema = res.request.schema_dict()
    if schema is not None and res.finish_reason == "stop":
        problem = schema_problem(res.text, schema)
        if problem:
            out.append(f"output {problem}")
    return out


def _first_diff(a: str, b: str) -> int:
    diffs = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(diffs, min(len(a), len(b)))
