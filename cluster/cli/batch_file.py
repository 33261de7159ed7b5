"""OpenAI's batch file format, line by line: what `kvray run-batch` reads and writes.

Input: JSONL, one request a line,
    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
Output: JSONL, one record per non-blank input line, in input order,
    {"id": "batch_req_...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}
A request the server answered, with any status (a 400 included), is a `response`; its body is
the server's JSON (OpenAI's error body for an error). A line that could not be sent at all
(not JSON, a field missing or of the wrong type, a method or url kvray does not take, a
custom_id an earlier line already used, a streaming body) is an `error` record instead:
    {"id": "batch_req_...", "custom_id": "r1" | null, "response": null,
     "error": {"code": "invalid_url", "message": "line 4: ..."}}

Duplicate custom_ids: OpenAI refuses a whole file that has any; vLLM runs them all. Here the
first line with a custom_id runs and every later one is an error record
(`duplicate_custom_id`), so a file streams through without a first pass over it, nothing is
lost, and a custom_id names at most one response.

Pure: no I/O beyond the text stream handed to OrderedWriter; imported by `kvray --help`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

# The routes a batch line may name: the OpenAI routes kvray serves that take a JSON body.
SUPPORTED_URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses")
METHOD = "POST"

# The codes of error records: a line that could not be sent ...
INVALID_JSON_LINE = "invalid_json_line"
MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
INVALID_PARAMETER = "invalid_parameter"
INVALID_METHOD = "invalid_method"
INVALID_URL = "invalid_url"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
# ... and for a request that was sent but got no HTTP answer (cluster/cli/batch_runner.py).
CONNECTION_ERROR = "connection_error"
REQUEST_TIMEOUT = "request_timeout"
REQUEST_FAILED = "request_failed"  # anything else that kept a request from its answer

_REQUIRED = ("custom_id", "method", "url", "body")


@dataclass(frozen=True)
class BatchRequest:
    """A line to send: POST `body` to `url` of the server."""

    line: int  # 1-based line number in the input (blank lines counted)
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineError:
    """A line that cannot be sent; becomes an error record."""

    line: int
    custom_id: str | None  # when the line names one (a string)
    code: str
    message: str  # starts with "line N: "


def parse_line(text: str, line: int) -> BatchRequest | LineError:
    """One input line (already known not to be blank) -> a request to send, or why not."""
    try:
        doc = json.loads(text)
    except ValueError as err:
        return LineError(line, None, INVALID_JSON_LINE, f"line {line}: not valid JSON: {err}")
    if not isinstance(doc, dict):
        return LineError(line, None, INVALID_JSON_LINE, f"line {line}: not a JSON object")
    raw_id = doc.get("custom_id")
    custom_id = raw_id if isinstance(raw_id, str) and raw_id else None

    def error(code: str, message: str) -> LineError:
        return LineError(line, custom_id, code, f"line {line}: {message}")

    missing = [k for k in _REQUIRED if doc.get(k) is None]
    if missing:
        return error(MISSING_REQUIRED_PARAMETER, f"missing {', '.join(missing)}")
    if custom_id is None:
        return error(INVALID_PARAMETER, f"custom_id must be a non-empty string, got {raw_id!r}")
    if doc["method"] != METHOD:
        return error(INVALID_METHOD, f"method {doc['method']!r}: only {METHOD} is supported")
    url = doc["url"]
    if url not in SUPPORTED_URLS:
        return error(INVALID_URL, f"url {url!r} is not supported: use {', '.join(SUPPORTED_URLS)}")
    body = doc["body"]
    if not isinstance(body, dict):
        return error(INVALID_PARAMETER, f"body must be a JSON object, got {type(body).__name__}")
    if body.get("stream"):
        return error(INVALID_PARAMETER, "body.stream: a batch gets whole responses; leave it out")
    return BatchRequest(line, custom_id, url, body)


class LineParser:
    """parse_line, plus the duplicate check: the first line with a custom_id keeps it."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def parse(self, text: str, line: int) -> BatchRequest | LineError:
        item = parse_line(text, line)
        cid = item.custom_id
        if cid is None:
            return item
        if cid in self._seen:
            message = f"line {line}: custom_id {cid!r} is already used by an earlier line"
            return LineError(line, cid, DUPLICATE_CUSTOM_ID, message)
        self._seen.add(cid)
        return item


def numbered_lines(lines: Iterable[str]) -> Iterator[tuple[int, str]]:
    """(line number, text) for each non-blank line; blank lines get no output record."""
    for number, text in enumerate(lines, start=1):
        text = text.strip()
        if text:
            yield number, text


def count_requests(lines: Iterable[str]) -> int:
    """The number of records a file will get (its non-blank lines), for the progress bar."""
    return sum(1 for _ in numbered_lines(lines))


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def result_record(
    custom_id: str, status_code: int, request_id: str, body: dict[str, Any]
) -> dict[str, Any]:
    """The record of a request the server answered (any status)."""
    return {
        "id": new_id("batch_req"),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


def error_record(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """The record of a line that got no HTTP answer."""
    return {
        "id": new_id("batch_req"),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def line_error_record(err: LineError) -> dict[str, Any]:
    return error_record(err.custom_id, err.code, err.message)


class OrderedWriter:
    """Writes records to `out` in input order as they complete: a record that finishes before
    an earlier one is held until that one is written. Flushes after each write, so the file
    always holds every result up to the first unfinished line."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._next = 0
        self._held: dict[int, dict[str, Any]] = {}

    def put(self, index: int, record: dict[str, Any]) -> int:
        """Record `index` (0-based, among the non-blank lines) is done; returns how many
        records this wrote (0 while an earlier one is still missing)."""
        if index < self._next or index in self._held:
            raise ValueError(f"record {index} was already put")
        self._held[index] = record
        wrote = 0
        while self._next in self._held:
            self._out.write(json.dumps(self._held.pop(self._next), ensure_ascii=False) + "\n")
            self._next += 1
            wrote += 1
        if wrote:
            self._out.flush()
        return wrote

    @property
    def written(self) -> int:
        return self._next

    @property
    def held(self) -> int:
        """Records done but waiting for an earlier one."""
        return len(self._held)
