"""AsyncEngine: the engine's step loop on a background thread, with asyncio streams in front.

The loop thread owns the LLMEngine (which is not thread-safe); callers talk to it through a
command queue. Each request's outputs flow back through an asyncio.Queue on the caller's
event loop. If a step raises, the engine is dead: every waiting caller gets EngineDeadError
at once, and so does every later call — nobody hangs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from workers.config import EngineArgs, EngineConfig
from workers.engine import LLMEngine
from workers.errors import EngineDeadError
from workers.outputs import RequestOutput
from workers.sampling_params import SamplingParams
from workers.stats import EngineStats

log = logging.getLogger(__name__)

_Command = tuple[Callable[[LLMEngine], Any], Future | None]


class AsyncEngine:
    def __init__(self, args: EngineArgs | EngineConfig, engine: LLMEngine | None = None) -> None:
        if engine is None:
            config = args.create_config() if isinstance(args, EngineArgs) else args
            engine = LLMEngine(config)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.config.served_model_name
        self.max_model_len = engine.max_model_len
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = engine.stats()
        self._dead: BaseException | None = None
        self._stopping = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="kvray-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, **kwargs: Any) -> AsyncEngine:
        return cls(EngineArgs(**kwargs))

    # -- public API ---------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine failed: {self._dead}") from self._dead
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")
        self.engine.executor.check_health()

    def stats(self) -> EngineStats:
        return self._stats

    def pop_step_token_counts(self) -> list[int]:
        return self._call(lambda e: e.pop_step_token_counts()).result()

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Streams RequestOutputs (cumulative + deltas); the last one has finished=True."""
        self.check_health()
        request_id = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt, params, stream=True)
            self._streams[request_id] = (loop, q)

        await asyncio.wrap_future(self._call(add))  # raises ValueError for bad input
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # cancelled or closed early: free the request's blocks now
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self._dead is None:
            self._call(lambda e: self._abort(e, request_id))

    def shutdown(self) -> None:
        self._stopping = True
        self._commands.put((lambda e: None, None))
        self._thread.join(timeout=30)
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - best effort on the way out
            log.exception("engine shutdown failed")

    # -- loop thread --------------------------------------------------------------------------
    def _call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        fut: Future = Future()
        if self._dead is not None:
            fut.set_exception(EngineDeadError(f"engine failed: {self._dead}"))
            return fut
        self._commands.put((fn, fut))
        if self._dead is not None and not fut.done():  # lost the race with a failure
            fut.set_exception(EngineDeadError(f"engine failed: {self._dead}"))
        return fut

    def _abort(self, engine: LLMEngine, request_id: str) -> None:
        out = engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and out is not None:
            self._deliver(stream, out)

    def _run_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            fn, fut = cmd
            try:
                result = fn(self.engine)
            except Exception as e:  # noqa: BLE001 - the caller gets it
                if fut is not None:
                    fut.set_exception(e)
            else:
                if fut is not None:
                    fut.set_result(result)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._run_commands(block=not engine.has_unfinished())
                if self._stopping:
                    break
                if not engine.has_unfinished():
                    self._stats = engine.stats()
                    continue
                # One hand-over per caller loop per step, not one per request: each
                # call_soon_threadsafe writes the loop's self-pipe, so this is one wake-up per
                # step however many streams (no throughput change measured on the demo model).
                batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
                for out in engine.step():
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        if out.finished:
                            del self._streams[out.request_id]
                        batches.setdefault(stream[0], []).append((stream[1], out))
                for loop, items in batches.items():
                    self._deliver_many(loop, items)
                self._stats = engine.stats()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine, loudly
            log.exception("engine step failed; failing all requests")
            self._fail_all(e)

    def _fail_all(self, cause: BaseException) -> None:
        self._dead = cause
        err = EngineDeadError(f"engine failed: {cause}")
        for stream in self._streams.values():
            self._deliver(stream, err)
        self._streams.clear()
        # Commands queued after the failure also get the error instead of waiting forever.
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut is not None and not fut.done():
                fut.set_exception(err)

    @staticmethod
    def _deliver(stream: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item: Any) -> None:
        loop, q = stream
        AsyncEngine._deliver_many(loop, [(q, item)])

    @staticmethod
    def _deliver_many(
        loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]
    ) -> None:
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)
