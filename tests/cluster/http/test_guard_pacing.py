"""RequestGuard's step 0: /health is answered before anything else, and a burst is let into
the app a few requests per turn of the event loop, so a probe arriving behind a burst is
answered within a turn or two of arriving instead of after the whole burst's work.

Driven as ASGI directly on one event loop; time is counted in loop turns, not seconds.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from cluster.http.guard import ADMIT_PER_TICK, RequestGuard
from cluster.ingress.auth import ApiKeyAuth

BURST = 100


class Turns:
    """Counts turns of the running event loop (a callback that re-schedules itself)."""

    def __init__(self) -> None:
        self.now = 0
        self._stopped = False

    def start(self) -> None:
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.now += 1
        if not self._stopped:
            asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._stopped = True


def _scope(method: str, path: str) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}


async def _request(guard: RequestGuard, method: str, path: str) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await guard(_scope(method, path), receive, send)
    return sent


def test_a_probe_behind_a_burst_is_answered_within_a_turn_or_two() -> None:
    turns = Turns()
    entered: list[int] = []  # the loop turn each request entered the app in

    async def app(scope: dict, receive: Any, send: Any) -> None:
        assert scope["path"] != "/health", "the guard answers the liveness probe itself"
        entered.append(turns.now)
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def main() -> tuple[list[dict[str, Any]], int, int]:
        guard = RequestGuard(app, ApiKeyAuth(None), 1 << 20)
        turns.start()
        burst = [
            asyncio.create_task(_request(guard, "POST", "/v1/completions")) for _ in range(BURST)
        ]
        await asyncio.sleep(0)  # the burst is on the loop first
        asked = turns.now
        probe = await _request(guard, "GET", "/health")
        answered = turns.now
        await asyncio.gather(*burst)
        turns.stop()
        return probe, answered - asked, max(entered)

    probe, probe_turns, last_entry = asyncio.run(main())
    assert probe[0]["status"] == 200 and json.loads(probe[1]["body"]) == {"status": "ok"}
    assert probe_turns <= 1  # answered at once, not after the burst
    # The burst went in ADMIT_PER_TICK a turn, in order of arrival, and all of it went in.
    assert len(entered) == BURST
    per_turn = {t: entered.count(t) for t in set(entered)}
    assert max(per_turn.values()) <= ADMIT_PER_TICK, per_turn
    assert last_entry >= BURST // ADMIT_PER_TICK - 1
    assert entered == sorted(entered)


def test_other_health_methods_and_ready_reach_the_app_unpaced() -> None:
    seen: list[tuple[str, str]] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        seen.append((scope["method"], scope["path"]))
        await send({"type": "http.response.start", "status": 405, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def main() -> None:
        guard = RequestGuard(app, ApiKeyAuth("sk-key"), 1 << 20)
        await _request(guard, "POST", "/health")
        await _request(guard, "GET", "/ready")  # a probe: no key needed, not paced

    asyncio.run(main())
    assert seen == [("POST", "/health"), ("GET", "/ready")]
