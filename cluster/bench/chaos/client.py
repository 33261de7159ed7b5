"""The HTTP client of `kvray bench serve --chaos`: one request in, one `ChaosResult` out.

Every request ends in one of three outcomes:

- `ok`: a complete answer (non-streamed: the JSON response; streamed: frames up to one
  carrying a finish reason and one carrying usage);
- `error`: the server answered with a failure: an HTTP status other than 200, or an error
  frame mid-stream. `clear` says whether it came with OpenAI's error body;
- `lost`: no answer: a connection error, the client's timeout, or a stream that ended without
  a finish reason, usage or error. The chaos run's goal is none of these.

Tenants: each request names its tenant by a header (`--chaos-tenant-header`, value
`tenant-<i>`) or, with a keys file, by tenant i's API key (`TenantIdentity`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.bench.chaos.workload import ChaosRequest, http_request
from cluster.bench.common.backend_types import BackendContext
from cluster.bench.common.backends import http_session, sse_messages

OK, ERROR, LOST = "ok", "error", "lost"


@dataclass
class ChaosResult:
    request: ChaosRequest
    sent: float  # time.perf_counter()
    outcome: str = LOST
    status: str = ""  # "200", "503", ... the error frame's code; or why it was lost
    clear: bool = True  # an error with OpenAI's error body
    error: str = ""
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    ttft: float | None = None  # streamed: seconds to the first text
    end: float = 0.0

    @property
    def e2e(self) -> float:
        return self.end - self.sent


@dataclass(frozen=True)
class TenantIdentity:
    """How request headers name tenant i."""

    header: str = "x-tenant-id"
    keys: tuple[str, ...] = ()  # tenant i's API key (a keys file); () = by header
    names: tuple[str, ...] = ()  # the keys' tenant names, for the report

    def name(self, tenant: int) -> str:
        return self.names[tenant] if self.keys else f"tenant-{tenant}"

    def headers(self, tenant: int, api_key: str | None) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.keys:
            h["Authorization"] = f"Bearer {self.keys[tenant]}"
            return h
        if api_key:
            h["Authorization"] = f"Bearer {api_key}"
        h[self.header] = self.name(tenant)
        return h


def keys_file_identity(path: str | Path, tenants: int) -> TenantIdentity:
    """The first key of each of the first `tenants` tenants a keys file names (the format of
    `kvray serve --api-keys-file`); ValueError when it names fewer."""
    import yaml

    doc = yaml.safe_load(Path(path).read_text())
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: no 'keys' list")
    first: dict[str, str] = {}
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("key"), str):
            raise ValueError(f"{path}: keys[{i}] has no key")
        first.setdefault(str(e.get("name") or f"keys[{i}]"), e["key"])
    if len(first) < tenants:
        raise ValueError(f"{path} names {len(first)} tenant(s); --chaos-tenants is {tenants}")
    names = tuple(first)[:tenants]
    return TenantIdentity(keys=tuple(first[n] for n in names), names=names)


class ChaosClient:
    def __init__(
        self, ctx: BackendContext, identity: TenantIdentity, timeout_s: float, session: Any
    ) -> None:
        self._ctx = ctx
        self._identity = identity
        self._timeout_s = timeout_s
        self._session = session
        self._base = (ctx.base_url or "").rstrip("/")

    @staticmethod
    def open(ctx: BackendContext, identity: TenantIdentity, timeout_s: float) -> ChaosClient:
        return ChaosClient(ctx, identity, timeout_s, http_session(ctx))

    async def send(self, req: ChaosRequest) -> ChaosResult:
        import aiohttp

        route, body = http_request(req, self._ctx.model)
        headers = self._identity.headers(req.tenant, self._ctx.api_key)
        res = ChaosResult(req, time.perf_counter())
        timeout = aiohttp.ClientTimeout(total=self._timeout_s)
        try:
            async with self._session.post(
                self._base + route, json=body, headers=headers, timeout=timeout
            ) as resp:
                res.status = str(resp.status)
                if resp.status != 200:
                    _http_error(res, await resp.text())
                elif req.stream:
                    await _read_stream(res, resp)
                else:
                    _read_json(res, await resp.json(content_type=None))
        except TimeoutError:
            res.outcome, res.status = LOST, "timeout"
            res.error = f"no answer in {self._timeout_s:g} s"
        except Exception as err:  # noqa: BLE001 - a lost request is a data point, not a crash
            res.outcome, res.status = LOST, "connection"
            res.error = f"{type(err).__name__}: {err}"[:300]
        res.end = time.perf_counter()
        return res

    async def close(self) -> None:
        await self._session.close()


def _http_error(res: ChaosResult, text: str) -> None:
    res.outcome = ERROR
    try:
        err = json.loads(text)["error"]
        res.error = str(err["message"])[:300]
    except (ValueError, KeyError, TypeError):
        res.clear, res.error = False, text[:300]


def _text_of(choice: dict[str, Any], api: str, streamed: bool) -> str:
    if api == "completions":
        return choice.get("text") or ""
    part = choice.get("delta" if streamed else "message") or {}
    return part.get("content") or ""


def _read_json(res: ChaosResult, msg: Any) -> None:
    try:
        choice = msg["choices"][0]
        res.text = _text_of(choice, res.request.api, streamed=False)
        res.finish_reason = choice.get("finish_reason")
        res.completion_tokens = int(msg["usage"]["completion_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        res.outcome, res.status, res.error = LOST, "malformed", str(msg)[:300]
        return
    res.outcome = OK


async def _read_stream(res: ChaosResult, resp: Any) -> None:
    usage = False
    pieces: list[str] = []
    async for now, msg in sse_messages(resp):
        err = msg.get("error")
        if err:
            res.outcome, res.status = ERROR, str(err.get("code") or "error")
            res.error = str(err.get("message"))[:300]
            return
        for choice in msg.get("choices") or ():
            text = _text_of(choice, res.request.api, streamed=True)
            if text:
                if res.ttft is None:
                    res.ttft = now - res.sent
                pieces.append(text)
            res.finish_reason = choice.get("finish_reason") or res.finish_reason
        if msg.get("usage"):
            res.completion_tokens = int(msg["usage"]["completion_tokens"])
            usage = True
    res.text = "".join(pieces)
    if res.finish_reason is None or not usage:
        res.outcome, res.status = LOST, "truncated"
        res.error = "the stream ended without " + ("usage" if usage else "a finish reason")
        return
    res.outcome = OK
