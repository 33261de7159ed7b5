"""The engine core on a background thread of this process (the `EngineCore` for TP > 1, tests
and in-process benchmarks; `workers.engine_process` is the other one).

The thread owns the LLMEngine (the engine is not thread-safe): callers' commands reach it
through a queue and run between steps.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from workers.engine import LLMEngine
from workers.engine_core import OutputSink
from workers.errors import EngineDeadError
from workers.inputs import EngineInput
from workers.stats import EngineStats

log = logging.getLogger(__name__)

_Command = tuple[Callable[[LLMEngine], Any], Future | None]


class EngineThread:
    """An `EngineCore`: the LLMEngine stepping on a thread of this process."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.config.served_model_name
        self.max_model_len = engine.max_model_len
        self.input_checker = engine.input_checker
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._stats = engine.stats()
        self._dead: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvray-engine", daemon=True)

    def start(self, sink: OutputSink) -> None:
        self._sink = sink
        self._thread.start()

    def add(self, request_id: str, inp: EngineInput) -> None:
        def add(engine: LLMEngine) -> None:
            try:
                engine.add_request(request_id, inp)
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
