"""The engine core in a child process, so its step loop never shares a GIL with a server.

In a Ray Serve replica the engine thread and Serve's request handling (gRPC, pickling,
routing-stats, streaming) share one interpreter: every millisecond Serve spends holding the
GIL is a millisecond the step loop waits. `EngineProcess` runs the LLMEngine in a child
process instead (as vLLM V1's EngineCore does; the child's side is
`workers.core.engine_child`) and talks to it over one socket pair, with the typed messages of
`workers.messages.core`: StartEngine, AddRequest, AbortRequest and StopEngine go down;
EngineReady, StepResult, RequestRejected, EngineFatal and EngineStopped come back.

One StepResult carries every output of one engine step, exactly what the requests' output
kinds asked for (running DELTA outputs hold deltas only), so nothing is stripped here and
both cores hand out the same outputs. A reader thread in the parent gives them to the sink
(`workers.frontend.async_engine.AsyncEngine`).

The child exits when the parent closes the socket, dies, or sends StopEngine; if the child dies,
the reader sees the socket close and fails every request with EngineDeadError. TP = 1 only:
for TP > 1 the forward pass already runs in the ranks' Ray actors.

Liveness: the parent knows which requests are in flight and when the child last sent a
StepResult (the child sends one after every step). With requests in flight and no StepResult
for `step_timeout_s` (a hung forward pass, a livelock), the reader thread fails every request
with EngineDeadError naming the timeout and kills the child; `check_health` says the same
without waiting for it.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path

from workers.config import EngineConfig
from workers.core.stats import EngineStats
from workers.errors import EngineDeadError
from workers.frontend.engine_core import OutputSink
from workers.inputs import EngineInput, InputChecker
from workers.messages.core import (
    AbortRequest,
    AddRequest,
    EngineFatal,
    EngineReady,
    EngineStopped,
    RequestRejected,
    StartEngine,
    StepResult,
    StopEngine,
    ToChild,
    ToParent,
)

log = logging.getLogger(__name__)


class EngineProcess:
    """An `EngineCore`, parent side: starts the child, sends it commands, reads its outputs on
    a thread."""

    def __init__(self, config: EngineConfig) -> None:
        from workers.tokenizer import Tokenizer

        self.model_name = config.served_model_name
        ours, theirs = socket.socketpair()
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "workers.core.engine_child", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=_child_env(),
            )
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._stats = EngineStats()
        self._step_counts: deque[int] = deque(maxlen=4096)
        self._stopping = False
        self._error: BaseException | None = None
        self._reader: threading.Thread | None = None
        self.step_timeout_s = config.parallel.step_timeout_s
        # Liveness, kept by the parent: requests sent and not yet finished, and the monotonic
        # time of the last sign of progress (a StepResult, or work arriving at an idle child).
        self._in_flight: set[str] = set()
        self._progress_lock = threading.Lock()
        self._last_progress = time.monotonic()
        self.pid = self._proc.pid
        msg: ToParent
        try:
            self._send(StartEngine(config))
            # While the child loads the model. The parent tokenizes nothing for the engine;
            # callers use the tokenizer for prompts, chat templates and /tokenize.
            self.tokenizer = Tokenizer.from_pretrained(config.model.tokenizer or config.model.path)
            msg = self._conn.recv()  # blocks until the child is ready (or gone)
        except (EOFError, OSError):
            msg = EngineFatal(f"engine process exited with code {self._proc.wait()}")
        except BaseException:  # the tokenizer failed, or we were interrupted: no orphan
            self._reap(timeout_s=0)
            raise
        if not isinstance(msg, EngineReady):
            self._reap(timeout_s=10)  # it is exiting on its own
            why = msg.message if isinstance(msg, EngineFatal) else repr(msg)
            raise EngineDeadError(f"engine process failed to start: {why}")
        # The child's limits: its max_model_len may have been capped to the KV cache it sized.
        self.input_checker: InputChecker = msg.input_checker
        self.max_model_len = msg.input_checker.max_model_len
        log.info("engine process %d ready: %d KV blocks", self.pid, msg.num_blocks)

    def start(self, sink: OutputSink) -> None:
        self._reader = threading.Thread(
            target=self._read_loop, args=(sink,), name="kvray-engine-reader", daemon=True
        )
        self._reader.start()

    # -- commands (any thread) ------------------------------------------------------------------
    def add(self, request_id: str, inp: EngineInput, queue_timeout_s: float | None = None) -> None:
        with self._progress_lock:
            if not self._in_flight:  # the clock starts when work arrives, not at the last step
                self._last_progress = time.monotonic()
            self._in_flight.add(request_id)
        self._send(AddRequest(request_id, inp, time.monotonic(), queue_timeout_s))

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))
        with self._progress_lock:
            self._in_flight.discard(request_id)  # aborted: nothing left to wait for

    def stats(self) -> EngineStats:
        return self._stats

    def pop_step_token_counts(self) -> list[int]:
        counts = []
        while self._step_counts:
            counts.append(self._step_counts.popleft())
        return counts

    def is_alive(self) -> bool:
        return self._error is None and self._proc.poll() is None

    def check_progress(self) -> None:
        """Cheap and never blocking: raises EngineDeadError when the engine failed, the child
        exited, or requests are in flight and no step completed in `step_timeout_s`."""
        stalled = self._stalled()
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error}")
        if stalled is not None:
            raise stalled
        code = self._proc.poll()
        if code is not None:
            raise EngineDeadError(f"engine process {self.pid} exited with code {code}")

    def check_health(self) -> None:
        self.check_progress()  # no ranks to ping: the child is the whole engine

    def shutdown(self) -> None:
        self._stopping = True
        try:
            self._send(StopEngine())
        except EngineDeadError:
            pass
        self._reap(timeout_s=30)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=5)

    # -- internals ------------------------------------------------------------------------------
    def _send(self, msg: ToChild) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError) as err:  # closed socket, or the child is gone
            raise EngineDeadError(f"engine process {self.pid} is not running: {err}") from None

    def _stalled(self) -> EngineDeadError | None:
        """The error when requests are in flight and no step completed in step_timeout_s."""
        with self._progress_lock:
            if not self._in_flight:
                return None
            waited = time.monotonic() - self._last_progress
        if waited <= self.step_timeout_s:
            return None
        return EngineDeadError(
            f"no engine step completed in {self.step_timeout_s:g} s with work pending "
            f"(step_timeout_s; {len(self._in_flight)} requests in flight, last step "
            f"{waited:.1f} s ago)"
        )

    def _read_loop(self, sink: OutputSink) -> None:
        # Wake up at least this often to check progress: a hang is noticed within
        # 1.25 x step_timeout_s.
        interval = min(max(self.step_timeout_s / 4, 0.01), 1.0)
        try:
            while True:
                if not self._conn.poll(interval):
                    stalled = self._stalled()
                    if stalled is not None and not self._stopping:
                        log.error("engine process %d: %s; killing it", self.pid, stalled)
                        self._fail(sink, stalled)
                        self._proc.kill()
                        return
                    continue
                msg: ToParent = self._conn.recv()
                if type(msg) is StepResult:
                    with self._progress_lock:
                        self._last_progress = time.monotonic()
                        for out in msg.outputs:
                            if out.finished:
                                self._in_flight.discard(out.request_id)
                    self._stats = msg.stats
                    self._step_counts.extend(msg.step_token_counts)
                    if msg.kv_events:
                        sink.kv_events(msg.kv_events)
                    if msg.outputs:
                        sink.outputs(msg.outputs)
                elif type(msg) is RequestRejected:
                    with self._progress_lock:
                        self._in_flight.discard(msg.request_id)
                    err = ValueError if msg.bad_input else RuntimeError
                    sink.rejected(msg.request_id, err(msg.message))
                elif type(msg) is EngineStopped:
                    return
                elif type(msg) is EngineFatal:  # the child's step loop failed; it is exiting
                    raise EngineDeadError(msg.message)
                else:
                    raise EngineDeadError(f"unexpected message from the engine process: {msg!r}")
        except (EOFError, OSError) as err:
            if self._stopping:
                return
            code = self._proc.wait()
            self._fail(sink, EngineDeadError(f"engine process {self.pid} exited (code {code})"))
            log.error("engine process %d exited (code %s): %s", self.pid, code, err)
        except BaseException as err:  # noqa: BLE001 - any failure kills the engine, loudly
            self._fail(sink, err)

    def _fail(self, sink: OutputSink, err: BaseException) -> None:
        self._error = err
        with self._progress_lock:
            self._in_flight.clear()
        sink.failed(err)

    def _reap(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for the child to exit, kills it after that; closes ours."""
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            if timeout_s:
                log.warning("engine process %d did not stop; killing it", self.pid)
            self._proc.kill()
            self._proc.wait()
        self._close()

    def _close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


def _child_env() -> dict[str, str]:
    """This environment, with the directory holding `workers` first on the child's path
    (a Ray worker may have found the package through its runtime env, not site-packages)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # workers/frontend/engine_process.py
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = root if not path else f"{root}{os.pathsep}{path}"
    return env
