"""Runs a batch file's lines against an OpenAI-compatible server over HTTP (`kvray run-batch`).

Memory stays bounded on a file of any size: at most `max_concurrency` requests are in flight,
and a line is read only once fewer than WINDOW_FACTOR x max_concurrency records are started
but not yet written (a slow early request holds back the output behind it, not the reading
of the whole file). Records are written in input order as they complete (OrderedWriter).

A 429 or 503 (the server's queue is full, or it is draining) and a refused or dropped
connection are retried up to `max_retries` times, after the server's Retry-After or an
exponential backoff; the last answer is the record. A timeout is not retried (the request
may still be running on the server).

aiohttp, not httpx: it is one of kvray's own dependencies (`kvray bench serve` uses it).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from cluster.cli.batch_file import (
    CONNECTION_ERROR,
    REQUEST_FAILED,
    REQUEST_TIMEOUT,
    BatchRequest,
    LineParser,
    OrderedWriter,
    error_record,
    line_error_record,
    new_id,
    result_record,
)

RETRY_STATUSES = (429, 503)
WINDOW_FACTOR = 16
MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class RunOptions:
    base_url: str  # http://host:8000 (a route prefix, if any, included; no /v1)
    api_key: str | None = None
    max_concurrency: int = 64
    max_retries: int = 3
    timeout_s: float = 600.0  # one request, from sending it to its whole answer
    progress: bool = True


@dataclass
class Tally:
    """What became of the lines."""

    ok: int = 0  # answered 2xx
    failed: int = 0  # answered with an error status
    not_run: int = 0  # an error record: a bad line, or no answer
    statuses: dict[int, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.ok + self.failed + self.not_run

    def count(self, record: dict[str, Any]) -> None:
        response = record["response"]
        if response is None:
            self.not_run += 1
            return
        status = response["status_code"]
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if 200 <= status < 300:
            self.ok += 1
        else:
            self.failed += 1

    def summary(self) -> str:
        codes = ", ".join(f"{n} x {s}" for s, n in sorted(self.statuses.items()))
        return (
            f"{self.total} request(s): {self.ok} succeeded, {self.failed} answered with an "
            f"error, {self.not_run} not run" + (f" (HTTP status: {codes})" if codes else "")
        )


def normalize_base_url(url: str) -> str:
    """The server's base URL without a trailing slash or /v1 (the lines' urls carry /v1)."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def retry_delay(attempt: int, retry_after: str | None) -> float:
    """Seconds to wait before retry `attempt` (0-based): the server's Retry-After (seconds)
    when it sent one, else 1, 2, 4, ... s; never more than MAX_BACKOFF_S."""
    if retry_after:
        try:
            return min(max(float(retry_after), 0.0), MAX_BACKOFF_S)
        except ValueError:
            pass  # an HTTP date: use the backoff
    return min(2.0**attempt, MAX_BACKOFF_S)


def response_body(text: str, status: int) -> dict[str, Any]:
    """The answer's JSON object; a body that is not one (a proxy's HTML error page) becomes
    OpenAI's error body holding its start."""
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        return doc
    kind = "invalid_request_error" if 400 <= status < 500 else "internal_error"
    message = f"the server answered {status} without a JSON object: {text[:500]!r}"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def check_server(options: RunOptions) -> str | None:
    """GET /v1/models once before the batch: None when the server answers it, else a
    one-line reason (unreachable, a wrong or missing key), so a batch does not turn every
    line into the same error."""
    import aiohttp

    url = f"{options.base_url}/v1/models"
    timeout = aiohttp.ClientTimeout(total=60)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url, headers=auth_headers(options.api_key)) as resp:
                if resp.status == 401:
                    return (
                        f"{url} answered 401: the server needs an API key (--api-key, or the "
                        "variable --api-key-env names)"
                    )
                if resp.status != 200:
                    return f"{url} answered {resp.status}: {(await resp.text())[:200]}"
    except (aiohttp.ClientError, TimeoutError) as err:
        return f"cannot reach {url}: {type(err).__name__}: {err}"
    return None


async def send(session: Any, options: RunOptions, req: BatchRequest) -> dict[str, Any]:
    """POSTs one line's body; the record of its answer (retried as the module says)."""
    import aiohttp

    url = options.base_url + req.url
    attempt = 0
    while True:
        try:
            async with session.post(url, json=req.body) as resp:
                text = await resp.text()
                retry = resp.status in RETRY_STATUSES and attempt < options.max_retries
                if not retry:
                    request_id = resp.headers.get("x-request-id") or new_id("req")
                    return result_record(
                        req.custom_id, resp.status, request_id, response_body(text, resp.status)
                    )
                delay = retry_delay(attempt, resp.headers.get("Retry-After"))
        except TimeoutError:  # aiohttp's own timeouts are TimeoutErrors too
            message = f"line {req.line}: no answer within {options.timeout_s:g} s (--timeout-s)"
            return error_record(req.custom_id, REQUEST_TIMEOUT, message)
        except aiohttp.ClientError as err:
            if attempt >= options.max_retries:
                message = (
                    f"line {req.line}: {type(err).__name__}: {err} (after {attempt + 1} attempt(s))"
                )
                return error_record(req.custom_id, CONNECTION_ERROR, message)
            delay = retry_delay(attempt, None)
        attempt += 1
        await asyncio.sleep(delay)


async def run_lines(
    lines: Iterator[tuple[int, str]],
    out: TextIO,
    options: RunOptions,
    total: int | None = None,
) -> Tally:
    """Every (line number, text) of `lines` -> one record in `out`, in order. `total` (the
    number of lines, when known) sizes the progress bar."""
    import aiohttp

    from cluster.bench.throughput.run import progress_bar

    writer = OrderedWriter(out)
    parser = LineParser()
    tally = Tally()
    # Released as records are written: bounds what is read ahead and held (module docstring).
    window = asyncio.Semaphore(WINDOW_FACTOR * options.max_concurrency)
    in_flight = asyncio.Semaphore(options.max_concurrency)
    tasks: set[asyncio.Task[None]] = set()
    bar = progress_bar(total, "requests", enabled=options.progress)

    def done(index: int, record: dict[str, Any]) -> None:
        tally.count(record)
        bar.update(1)
        for _ in range(writer.put(index, record)):
            window.release()

    async def run_one(index: int, req: BatchRequest) -> None:
        async with in_flight:
            try:
                record = await send(session, options, req)
            except Exception as err:  # never lose a line: anything unforeseen is its record
                message = f"line {req.line}: {type(err).__name__}: {err}"
                record = error_record(req.custom_id, REQUEST_FAILED, message)
        done(index, record)

    connector = aiohttp.TCPConnector(limit=options.max_concurrency)
    timeout = aiohttp.ClientTimeout(total=options.timeout_s)
    headers = auth_headers(options.api_key)
    try:
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, headers=headers
        ) as session:
            index = 0
            while True:
                await window.acquire()
                # A pipe on stdin may block: read off the event loop.
                item = await asyncio.to_thread(next, lines, None)
                if item is None:
                    break
                parsed = parser.parse(item[1], item[0])
                if isinstance(parsed, BatchRequest):
                    task = asyncio.create_task(run_one(index, parsed))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                else:
                    done(index, line_error_record(parsed))
                index += 1
            if tasks:
                await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        bar.close()
    return tally
