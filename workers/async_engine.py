"""AsyncEngine: asyncio streams in front of an engine core that steps on its own.

The core is either a thread of this process that owns the LLMEngine (`EngineThread`, the
default) or a child process (`workers.engine_process.EngineProcess`, `process=True`), which
keeps the step loop off this interpreter's GIL: what a server wants. Either way callers talk
to the core through commands, and each request's outputs flow back through an asyncio.Queue
on the caller's event loop. If the core fails, the engine is dead: every waiting caller gets
EngineDeadError at once, and so does every later call — nobody hangs.

Running outputs carry the deltas; with the thread core they also carry the cumulative
fields, with the process core those are empty (they would cross the socket every step). The
finished output carries everything either way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, Protocol

from workers.config import EngineArgs, EngineConfig
from workers.engine import LLMEngine
from workers.errors import EngineDeadError
from workers.outputs import RequestOutput
from workers.sampling_params import SamplingParams
from workers.stats import EngineStats

log = logging.getLogger(__name__)

_Stream = tuple[asyncio.AbstractEventLoop, asyncio.Queue]


class EngineCore(Protocol):
    """What AsyncEngine needs of a core; outputs arrive through the sink given to start()."""

    tokenizer: Any
    model_name: str
    max_model_len: int

    def start(self, sink: Any) -> None: ...
    def add(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def stats(self) -> EngineStats: ...
    def pop_step_token_counts(self) -> list[int]: ...
    def is_alive(self) -> bool: ...  # cheap: no round trip to the ranks
    def check_health(self) -> None: ...
    def shutdown(self) -> None: ...


class AsyncEngine:
    def __init__(
        self,
        args: EngineArgs | EngineConfig,
        engine: LLMEngine | None = None,
        *,
        process: bool = False,
    ) -> None:
        def config() -> EngineConfig:
            return args.create_config() if isinstance(args, EngineArgs) else args

        if process:
            from workers.engine_process import EngineProcess

            if engine is not None:
                raise ValueError("process=True builds its engine in the child; pass no engine")
            self._core: EngineCore = EngineProcess(config())
        else:
            self._core = EngineThread(engine or LLMEngine(config()))
        self.tokenizer = self._core.tokenizer
        self.model_name = self._core.model_name
        self.max_model_len = self._core.max_model_len
        self._streams: dict[str, _Stream] = {}
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        self._core.start(self)

    @classmethod
    def from_args(cls, **kwargs: Any) -> AsyncEngine:
        return cls(EngineArgs(**kwargs))

    # -- public API ---------------------------------------------------------------------------
    @property
    def engine(self) -> LLMEngine | None:
        """The LLMEngine when it runs in this process (thread core), else None."""
        return getattr(self._core, "engine", None)

    @property
    def in_process(self) -> bool:
        return isinstance(self._core, EngineThread)

    @property
    def healthy(self) -> bool:
        return self._dead is None and self._core.is_alive()

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine failed: {self._dead}") from self._dead
        self._core.check_health()

    def stats(self) -> EngineStats:
        return self._core.stats()

    def pop_step_token_counts(self) -> list[int]:
        return self._core.pop_step_token_counts()

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Streams RequestOutputs (deltas, see the module doc); the last has finished=True.
        Bad input raises ValueError before the first output."""
        self.check_health()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        # Registered before the core sees the request, so no output can miss its stream.
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            if self._dead is not None:  # lost the race with a failure
                raise EngineDeadError(f"engine failed: {self._dead}")
            self._core.add(request_id, prompt, params)
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True  # a rejected or failed request holds nothing in the core
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # cancelled or closed early: free the request's blocks now
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self._dead is None:
            try:
                self._core.abort(request_id)
            except EngineDeadError:
                pass  # the failure reaches every caller through failed()

    def shutdown(self) -> None:
        self._core.shutdown()

    # -- the sink: called on the core's thread ------------------------------------------------
    def outputs(self, outs: list[RequestOutput]) -> None:
        # One hand-over per caller loop per step, not one per request: each
        # call_soon_threadsafe writes the loop's self-pipe, so this is one wake-up per step
        # however many streams (no throughput change measured on the demo model).
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                if out.finished:
                    # pop, not del: the caller's loop may be dropping the stream right now.
                    self._streams.pop(out.request_id, None)
                batches.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in batches.items():
            _deliver_many(loop, items)

    def rejected(self, request_id: str, err: Exception) -> None:
        """The core refused the request (ValueError: bad input); its caller gets `err`."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            _deliver_many(stream[0], [(stream[1], err)])

    def failed(self, cause: BaseException) -> None:
        self._dead = cause  # first, so a stream registered from now on sees it
        err = EngineDeadError(f"engine failed: {cause}")
        for rid in list(self._streams):
            stream = self._streams.pop(rid, None)
            if stream is not None:
                _deliver_many(stream[0], [(stream[1], err)])


class EngineThread:
    """The LLMEngine on a background thread of this process, which owns it (the engine is not
    thread-safe): callers' commands reach it through a queue, run between steps."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.config.served_model_name
        self.max_model_len = engine.max_model_len
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future | None]] = (
            queue.SimpleQueue()
        )
        self._stats = engine.stats()
        self._dead: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvray-engine", daemon=True)

    def start(self, sink: Any) -> None:
        self._sink = sink
        self._thread.start()

    def add(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        def add(engine: LLMEngine) -> None:
            try:
                engine.add_request(request_id, prompt, params, stream=True)
            except Exception as err:  # noqa: BLE001 - the caller gets it, nobody waits forever
                self._sink.rejected(request_id, err)

        self._call(add)

    def abort(self, request_id: str) -> None:
        def abort(engine: LLMEngine) -> None:
            out = engine.abort(request_id)
            if out is not None:
                self._sink.outputs([out])

        self._call(abort)

    def stats(self) -> EngineStats:
        return self._stats

    def pop_step_token_counts(self) -> list[int]:
        """Waits for the engine thread's next command slot."""
        return self._call(lambda e: e.pop_step_token_counts()).result()

    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine failed: {self._dead}") from self._dead
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")
        self.engine.executor.check_health()

    def shutdown(self) -> None:
        self._stopping = True
        self._commands.put((lambda e: None, None))
        self._thread.join(timeout=30)
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - best effort on the way out
            log.exception("engine shutdown failed")

    def _call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        fut: Future = Future()
        if self._dead is not None:
            fut.set_exception(EngineDeadError(f"engine failed: {self._dead}"))
            return fut
        self._commands.put((fn, fut))
        if self._dead is not None and not fut.done():  # lost the race with a failure
            fut.set_exception(EngineDeadError(f"engine failed: {self._dead}"))
        return fut

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
                if engine.has_unfinished():
                    outs = engine.step()
                    if outs:
                        self._sink.outputs(outs)
                self._stats = engine.stats()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine, loudly
            log.exception("engine step failed; failing all requests")
            self._dead = e
            self._sink.failed(e)
            # Commands queued after the failure also get the error instead of waiting forever.
            err = EngineDeadError(f"engine failed: {e}")
            while True:
                try:
                    _, fut = self._commands.get_nowait()
                except queue.Empty:
                    break
                if fut is not None and not fut.done():
                    fut.set_exception(err)


def _deliver_many(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]) -> None:
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the caller's loop is closed: nobody is listening
        pass


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)
