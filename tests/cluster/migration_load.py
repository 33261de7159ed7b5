"""Load and faults for the migration tests: long requests over every API, their expected text
from the offline engine, and ways to kill what serves them.

A load is 32 requests of 128-256 tokens (ignore_eos, so usage is exact), half greedy and
half seeded sampling, spread over HTTP streamed / not streamed and gRPC GenerateStream /
Generate. `expected_texts` runs the same requests through the offline `workers.LLM`: greedy
and seeded sampling do not depend on batching or on the replica, so a request that moved
between replicas mid-stream must still produce exactly that text.
"""

from __future__ import annotations

import os
import random
import signal
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.cluster.serve_helpers import App, replica_stats

VIAS = ("http_stream", "grpc_stream", "http", "grpc")
CLIENT_TIMEOUT_S = 240.0  # hang guard per request
_IDS = range(300, 3000)  # inside the demo vocabulary, outside its special tokens


@dataclass(frozen=True)
class LoadRequest:
    index: int
    prompt: list[int]
    max_tokens: int
    seed: int | None  # None: greedy
    via: str

    @property
    def sampling(self) -> dict[str, Any]:
        if self.seed is None:
            return {"temperature": 0.0}
        return {"temperature": 0.8, "top_p": 0.95, "seed": self.seed}


@dataclass
class Result:
    request: LoadRequest
    text: str = ""
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    tokens_seen: int = 0  # streamed pieces with text so far (progress of streamed requests)
    done: bool = False


@dataclass
class Load:
    results: list[Result]
    futures: list[Future] = field(default_factory=list)

    def streamed_progress(self) -> int:
        """The fewest pieces any running streamed request has received (0 until all started);
        a stream already over (a short one coalesced into few chunks) does not hold it back."""
        streamed = [r for r in self.results if r.request.via.endswith("_stream")]
        return min(10**9 if r.done else r.tokens_seen for r in streamed)

    def wait(self, timeout_s: float = CLIENT_TIMEOUT_S) -> list[Result]:
        for f in self.futures:
            f.result(timeout=timeout_s)
        return self.results


def build_load(
    seed: int,
    count: int = 32,
    prompt_len: int = 24,
    min_tokens: int = 128,
    max_tokens: int = 256,
    vias: tuple[str, ...] = VIAS,
) -> list[LoadRequest]:
    rng = random.Random(seed)
    return [
        LoadRequest(
            index=i,
            prompt=rng.choices(_IDS, k=prompt_len),
            max_tokens=rng.randint(min_tokens, max_tokens),
            seed=None if i % 2 == 0 else 1000 + i,
            via=vias[(i // 2) % len(vias)],
        )
        for i in range(count)
    ]


def expected_texts(model_dir: Path, requests: list[LoadRequest]) -> list[str]:
    """The offline engine's text for each request (float32, like the CPU replicas)."""
    from workers import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=256 * 1024 * 1024)
    params = [
        SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, **r.sampling) for r in requests
    ]
    outs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    llm.engine.shutdown()
    return [o.outputs[0].text for o in outs]


def start_load(app: App, grpc_port: int, requests: list[LoadRequest]) -> Load:
    """Sends every request at once, each on its own thread; returns without waiting."""
    load = Load([Result(r) for r in requests])
    pool = ThreadPoolExecutor(len(requests), thread_name_prefix="migration-load")
    load.futures = [pool.submit(_run, app, grpc_port, res) for res in load.results]
    pool.shutdown(wait=False)
    return load


def _run(app: App, grpc_port: int, res: Result) -> None:
    try:
        if res.request.via.startswith("http"):
            _http(app, res)
        else:
            _grpc(app, grpc_port, res)
    except Exception as err:  # the assertion names every failed request
        res.error = f"{type(err).__name__}: {err}"
    finally:
        res.done = True


def _http(app: App, res: Result) -> None:
    import openai

    client = openai.OpenAI(
        base_url=f"{app.base_url}/v1",
        api_key=app.api_key or "unused",
        max_retries=0,
        timeout=CLIENT_TIMEOUT_S,
    )
    r = res.request
    body: dict[str, Any] = {
        "model": app.model,
        "prompt": r.prompt,
        "max_tokens": r.max_tokens,
        "extra_body": {"ignore_eos": True},
        **r.sampling,
    }
    if r.via == "http":
        out = client.completions.create(**body)
        res.text, res.finish_reason = out.choices[0].text, out.choices[0].finish_reason
        res.completion_tokens = out.usage.completion_tokens
        return
    parts: list[str] = []
    for chunk in client.completions.create(
        **body, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            res.tokens_seen += 1
            res.finish_reason = chunk.choices[0].finish_reason or res.finish_reason
        if chunk.usage is not None:
            res.completion_tokens = chunk.usage.completion_tokens
    res.text = "".join(parts)


def _finish_name(number: int) -> str | None:
    """A gRPC Completion.finish_reason as the HTTP API names it (None while unset)."""
    from kvray.v1 import llm_pb2

    enum = llm_pb2.Completion.DESCRIPTOR.fields_by_name["finish_reason"].enum_type
    name = enum.values_by_number[number].name.removeprefix("FINISH_REASON_").lower()
    return None if name == "unspecified" else name


def _grpc(app: App, grpc_port: int, res: Result) -> None:
    from cluster.grpc_api.client import KvrayClient

    r = res.request
    kwargs = {"max_tokens": r.max_tokens, "ignore_eos": True, "timeout": CLIENT_TIMEOUT_S}
    with KvrayClient(f"127.0.0.1:{grpc_port}", api_key=app.api_key) as client:
        if r.via == "grpc":
            reply = client.generate(r.prompt, **kwargs, **r.sampling)
            (c,) = reply.completions
            res.text, res.finish_reason = c.text, _finish_name(c.finish_reason)
            res.completion_tokens = reply.usage.completion_tokens
            return
        parts: list[str] = []
        for piece in client.generate_stream(r.prompt, **kwargs, **r.sampling):
            for c in piece.completions:
                parts.append(c.text)
                res.tokens_seen += 1
                res.finish_reason = _finish_name(c.finish_reason) or res.finish_reason
            if piece.HasField("usage"):
                res.completion_tokens = piece.usage.completion_tokens
        res.text = "".join(parts)


def failures(results: list[Result], expected: list[str]) -> list[str]:
    """Every way a request differs from its undisturbed run (empty: all exact)."""
    bad = []
    for res, want in zip(results, expected, strict=True):
        r = res.request
        tag = f"#{r.index} {r.via} {'greedy' if r.seed is None else 'seeded'}"
        if res.error is not None:
            bad.append(f"{tag}: {res.error}")
        elif res.text != want:
            bad.append(f"{tag}: text differs at char {_first_diff(res.text, want)}")
        elif res.completion_tokens != r.max_tokens or res.finish_reason != "length":
            bad.append(f"{tag}: usage {res.completion_tokens} / finish {res.finish_reason}")
    return bad


def _first_diff(a: str, b: str) -> int:
    diffs = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(diffs, min(len(a), len(b)))


def busiest_replica(app: App, replicas: int) -> dict[str, Any]:
    """The stats of the replica running the most requests now."""
    stats = replica_stats(app, replicas)
    return max(stats.values(), key=lambda s: s["num_requests_running"])


def kill_pid(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
