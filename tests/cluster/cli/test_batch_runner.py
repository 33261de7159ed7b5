"""The batch runner's HTTP side against small real HTTP servers (aiohttp, in this process):
order kept when answers come back out of order, 429/503 retried after Retry-After, no
answer (refused, timed out) as an error record, reading held back behind a slow early
request, the server check. The round trip against kvray itself: test_run_batch.py."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from cluster.cli.batch_runner import (
    MAX_BACKOFF_S,
    WINDOW_FACTOR,
    RunOptions,
    Tally,
    check_server,
    normalize_base_url,
    response_body,
    retry_delay,
    run_lines,
)
from tests.cluster.serve_helpers import free_port

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def _server(handler: Handler) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)  # a slow handler does not hold it up
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _lines(*bodies: dict[str, Any], url: str = "/v1/completions") -> list[tuple[int, str]]:
    return [
        (i + 1, json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": b}))
        for i, b in enumerate(bodies)
    ]


def _run(lines: Any, base_url: str, **options: Any) -> tuple[list[dict[str, Any]], Tally]:
    out = io.StringIO()
    opts = RunOptions(base_url=base_url, progress=False, **options)
    tally = asyncio.run(run_lines(iter(lines), out, opts, len(lines)))
    return [json.loads(x) for x in out.getvalue().splitlines()], tally


async def _echo_after_delay(request: web.Request) -> web.Response:
    body = await request.json()
    await asyncio.sleep(body.get("delay", 0))
    return web.json_response(
        {"path": request.path, "auth": request.headers.get("Authorization"), **body},
        headers={"x-request-id": f"q-{body.get('n')}"},
    )


def test_answers_that_arrive_out_of_order_are_written_in_input_order() -> None:
    async def main() -> tuple[list[dict[str, Any]], Tally]:
        async with _server(_echo_after_delay) as url:
            # Later lines answer first; a bad line in between is written in its place.
            lines = _lines(*({"n": i, "delay": 0.05 * (6 - i)} for i in range(6)))
            lines.insert(3, (99, "{oops"))
            return await asyncio.to_thread(_run, lines, url, api_key="k", max_concurrency=8)

    records, tally = asyncio.run(main())
    assert [r["custom_id"] for r in records] == ["r0", "r1", "r2", None, "r3", "r4", "r5"]
    assert records[3]["error"]["code"] == "invalid_json_line"
    ok = [r for r in records if r["response"]]
    assert [r["response"]["body"]["n"] for r in ok] == [0, 1, 2, 3, 4, 5]
    assert all(r["response"]["status_code"] == 200 for r in ok)
    assert ok[0]["response"]["request_id"] == "q-0"  # the server's x-request-id
    assert ok[0]["response"]["body"]["auth"] == "Bearer k"
    assert ok[0]["response"]["body"]["path"] == "/v1/completions"
    assert (tally.ok, tally.failed, tally.not_run) == (6, 0, 1)


def test_429_and_503_are_retried_after_retry_after_then_the_last_answer_is_the_record() -> None:
    calls: dict[str, int] = {}

    async def busy_then_ok(request: web.Request) -> web.Response:
        body = await request.json()
        key = body["key"]
        calls[key] = calls.get(key, 0) + 1
        if calls[key] <= body["busy"]:
            status = 429 if calls[key] % 2 else 503
            return web.json_response(
                {"error": {"message": "busy", "type": "rate_limit_exceeded", "code": status}},
                status=status,
                headers={"Retry-After": "0"},
            )
        return web.json_response({"ok": key})

    async def main() -> tuple[list[dict[str, Any]], Tally]:
        async with _server(busy_then_ok) as url:
            lines = _lines({"key": "a", "busy": 2}, {"key": "b", "busy": 5})
            return await asyncio.to_thread(_run, lines, url, max_retries=2)

    records, tally = asyncio.run(main())
    assert records[0]["response"]["status_code"] == 200
    assert records[0]["response"]["body"] == {"ok": "a"}
    # Out of retries: the third answer (a 429) is the record, with the server's body.
    assert records[1]["response"]["status_code"] == 429
    assert records[1]["response"]["body"]["error"]["type"] == "rate_limit_exceeded"
    assert calls == {"a": 3, "b": 3}
    assert (tally.ok, tally.failed) == (1, 1) and tally.statuses == {200: 1, 429: 1}


def test_no_answer_is_an_error_record_and_a_non_json_answer_an_error_body() -> None:
    async def slow_or_html(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("slow"):
            await asyncio.sleep(3)
        return web.Response(text="<html>bad gateway</html>", status=502)

    async def main() -> tuple[list[dict[str, Any]], Tally]:
        async with _server(slow_or_html) as url:
            lines = _lines({"slow": True}, {})
            return await asyncio.to_thread(_run, lines, url, timeout_s=0.5)

    records, _ = asyncio.run(main())
    assert records[0]["response"] is None
    assert records[0]["error"]["code"] == "request_timeout"
    assert records[0]["error"]["message"].startswith("line 1: no answer within 0.5 s")
    assert records[1]["response"]["status_code"] == 502
    error = records[1]["response"]["body"]["error"]
    assert error["code"] == 502 and "bad gateway" in error["message"]
    # Nobody listening: refused, retried, then an error record per line.
    refused, tally = _run(_lines({}, {}), f"http://127.0.0.1:{free_port()}", max_retries=1)
    assert [r["error"]["code"] for r in refused] == ["connection_error"] * 2
    assert "after 2 attempt(s)" in refused[0]["error"]["message"]
    assert tally.not_run == 2


def test_reading_waits_while_a_slow_first_request_holds_back_the_output() -> None:
    read = 0
    release = asyncio.Event()

    def counted(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
        nonlocal read
        for item in lines:
            read += 1
            yield item

    async def first_waits(request: web.Request) -> web.Response:
        body = await request.json()
        if body["n"] == 0:
            await release.wait()
        return web.json_response(body)

    async def main() -> list[str]:
        nonlocal release
        release = asyncio.Event()
        async with _server(first_waits) as url:
            lines = _lines(*({"n": i} for i in range(WINDOW_FACTOR * 2 + 5)))
            out = io.StringIO()
            opts = RunOptions(base_url=url, max_concurrency=2, progress=False)
            task = asyncio.create_task(run_lines(counted(lines), out, opts))
            for _ in range(3000):  # a hang guard of 30 s
                if read >= WINDOW_FACTOR * 2:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # every answer but the first has come back by now
            assert read == WINDOW_FACTOR * 2, read  # the window: 16 x max_concurrency
            assert out.getvalue() == ""  # the first record holds back the rest
            release.set()
            await task
            return out.getvalue().splitlines()

    written = asyncio.run(main())
    assert [json.loads(x)["custom_id"] for x in written] == [f"r{i}" for i in range(37)]


def test_the_server_check_names_an_unreachable_server_and_a_missing_key() -> None:
    async def needs_key(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer good":
            return web.json_response({"error": {"message": "no"}}, status=401)
        return web.json_response({"data": [{"id": "m"}]})

    async def main() -> list[str | None]:
        async with _server(needs_key) as url:
            return [
                await check_server(RunOptions(base_url=url, api_key="good")),
                await check_server(RunOptions(base_url=url)),
                await check_server(RunOptions(base_url=f"http://127.0.0.1:{free_port()}")),
            ]

    ok, no_key, unreachable = asyncio.run(main())
    assert ok is None
    assert no_key is not None and "401" in no_key and "--api-key" in no_key
    assert unreachable is not None and unreachable.startswith("cannot reach http://127.0.0.1:")


def test_helpers() -> None:
    assert normalize_base_url("http://h:8000/") == "http://h:8000"
    assert normalize_base_url("http://h:8000/v1/") == "http://h:8000"
    assert normalize_base_url("http://h:8000/main") == "http://h:8000/main"
    assert [retry_delay(a, None) for a in range(3)] == [1.0, 2.0, 4.0]
    assert retry_delay(10, None) == MAX_BACKOFF_S
    assert retry_delay(0, "7") == 7.0 and retry_delay(0, "9999") == MAX_BACKOFF_S
    assert retry_delay(1, "Wed, 21 Oct 2015 07:28:00 GMT") == 2.0
    assert response_body('{"a": 1}', 200) == {"a": 1}
    assert response_body("[1]", 500)["error"]["type"] == "internal_error"
    tally = Tally()
    for status in (200, 200, 400):
        tally.count({"response": {"status_code": status}})
    tally.count({"response": None})
    assert tally.summary() == (
        "4 request(s): 2 succeeded, 1 answered with an error, 1 not run "
        "(HTTP status: 2 x 200, 1 x 400)"
    )
