"""The engine core on a background thread of this process (the `EngineCore` for TP > 1, tests
and in-process benchmarks; `workers.frontend.engine_process` is the other one).

The thread owns the LLMEngine (the engine is not thread-safe): callers' commands reach it
through a queue and run between steps.

Liveness: the loop records when the step in progress started. A watchdog thread (and
`check_health`) fails the engine when a step has run longer than `step_timeout_s` (a hung
forward pass, a livelock): every waiting caller gets EngineDeadError naming the timeout, instead
of waiting forever. A Python thread cannot be killed, so a hung step is abandoned: if it ever
returns, the loop sees the engine is dead and stops.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from workers.core.engine import LLMEngine
from workers.core.stats import EngineStats
from workers.errors import EngineDeadError
from workers.frontend.engine_core import OutputSink
from workers.inputs import EngineInput

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
        self._fail_lock = threading.Lock()
        parallel = engine.config.parallel
        # TP > 1: the Ray executor's own watchdog (same step_timeout_s) names the stuck rank;
        # this one is only the backstop, late enough never to race it.
        self.step_timeout_s = parallel.step_timeout_s * (
            1 if parallel.tensor_parallel_size == 1 else 2
        )
        # monotonic time the step in progress started; None between steps (idle or commands).
        self._step_started: float | None = None
        self._thread = threading.Thread(target=self._loop, name="kvray-engine", daemon=True)
        self._watchdog = threading.Event()  # set: stop watching
        self._watchdog_thread = threading.Thread(
            target=self._watch, name="kvray-engine-watchdog", daemon=True
        )

    def start(self, sink: OutputSink) -> None:
        self._sink = sink
        self._thread.start()
        self._watchdog_thread.start()

    def add(self, request_id: str, inp: EngineInput, queue_timeout_s: float | None = None) -> None:
        arrival = time.monotonic()

        def add(engine: LLMEngine) -> None:
            try:
                engine.add_request(request_id, inp, arrival, queue_timeout_s)
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

    def check_progress(self) -> None:
        """Cheap and never blocking (no round trip to the ranks): raises EngineDeadError when
        the engine is dead, its loop is gone, or a step has run past `step_timeout_s` (which
        fails the engine and every waiting caller)."""
        self._check_step_time()
        if self._dead is not None:
            raise EngineDeadError(f"engine failed: {self._dead}") from self._dead
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")

    def check_health(self) -> None:
        """`check_progress`, then the executor's own check (TP > 1: a blocking ping of every
        rank — call it off an event loop)."""
        self.check_progress()
        self.engine.executor.check_health()

    def shutdown(self) -> None:
        self._stopping = True
        self._watchdog.set()
        self._commands.put((lambda e: None, None))
        # A step abandoned by the watchdog may never return: do not wait for it long.
        self._thread.join(timeout=30 if self._dead is None else 1)
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

    def _check_step_time(self) -> None:
        started = self._step_started
        if started is None or self._dead is not None:
            return
        waited = time.monotonic() - started
        if waited > self.step_timeout_s:
            self._fail(
                EngineDeadError(
                    f"no engine step completed in {self.step_timeout_s:g} s with work pending "
                    f"(step_timeout_s; the step in progress has run {waited:.1f} s)"
                )
            )

    def _watch(self) -> None:
        # A quarter of the timeout: a hang is noticed within 1.25 x step_timeout_s.
        interval = min(max(self.step_timeout_s / 4, 0.01), 1.0)
        while not self._watchdog.wait(interval) and self._dead is None:
            self._check_step_time()

    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stopping and self._dead is None:
                self._run_commands(block=not engine.has_unfinished())
                if self._stopping:
                    break
                outs = None
                if engine.has_unfinished():
                    self._step_started = time.monotonic()
                    outs = engine.step()
                    self._step_started = None
                    if self._dead is not None:  # the watchdog gave up on this step
                        break
                # A step's KV events before its outputs, as the engine process sends them:
                # the cluster KV tier queues a step's blocks for publishing before a caller
                # sees the output (a prefill replica's hand-off waits for them).
                kv_events = engine.block_manager.pop_kv_events()
                if kv_events:
                    self._sink.kv_events(kv_events)
                if outs:
                    self._sink.outputs(outs)
                self._stats = engine.stats()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine, loudly
            log.exception("engine step failed; failing all requests")
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        """Once: the engine is dead, every waiting caller and queued command gets the error."""
        with self._fail_lock:
            if self._dead is not None:
                return
            self._dead = e
        if isinstance(e, EngineDeadError):
            log.error("%s; failing all requests", e)
        self._sink.failed(e)
        self._drain_commands(EngineDeadError(f"engine failed: {e}"))

    def _drain_commands(self, err: EngineDeadError) -> None:
        # Commands queued after the failure also get the error instead of waiting forever.
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut is not None and not fut.done():
                fut.set_exception(err)
