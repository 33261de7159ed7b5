"""The engine core's child process: `python -m workers.core.engine_child FD`, started by
`workers.frontend.engine_process.EngineProcess` (the parent side) with one end of a socket
pair. It builds the LLMEngine, then reads the parent's commands (`workers.messages.core`:
StartEngine, AddRequest, AbortRequest, StopEngine) and steps, sending EngineReady,
StepResult, RequestRejected, EngineFatal and EngineStopped back. As vLLM splits its engine
core client (the caller's side) from the engine core process, the caller's side of this
conversation lives in workers/frontend/ and this side here, in the core's package.

The child exits when the parent closes the socket, dies, or sends StopEngine.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

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
)
from workers.outputs import RequestOutput

log = logging.getLogger(__name__)

# How often the child checks that its parent is still there (a parent killed while the child
# is busy loading or stepping is noticed here, not only at the next socket write).
PARENT_CHECK_S = 1.0

# Test hooks (fault injection), read in the child when it starts; never set them outside
# tests. TEST_STEP_SLEEP_ENV: seconds every engine step sleeps first, to make a hung step.
# TEST_STEP_SLEEP_ONCE_ENV: a file path; with it, only the first engine to create that file
# sleeps, so one replica of an app hangs while the others (and its replacement) do not.
TEST_STEP_SLEEP_ENV = "KVRAY_TEST_HOOK_STEP_SLEEP_S"
TEST_STEP_SLEEP_ONCE_ENV = "KVRAY_TEST_HOOK_STEP_SLEEP_ONCE_FILE"


def serve_engine(conn: Connection) -> int:
    """The child's whole life: build the engine, then read commands and step until told to
    stop or the parent goes away. Returns the exit code."""
    from workers.core.engine import LLMEngine

    start: StartEngine = conn.recv()
    try:
        engine = LLMEngine(start.config)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(EngineFatal(traceback.format_exc(limit=5)))
        return 1
    conn.send(EngineReady(engine.block_manager.num_blocks, engine.input_checker))
    last_stats = None
    step_sleep_s = _test_step_sleep_s()
    try:
        while True:
            outs: list[RequestOutput] = []
            # Block while idle; between steps take whatever arrived, without waiting.
            timeout = 0.0 if engine.has_unfinished() else None
            while conn.poll(timeout):
                msg: ToChild = conn.recv()
                if type(msg) is AddRequest:
                    try:
                        engine.add_request(
                            msg.request_id, msg.input, msg.arrival_time, msg.queue_timeout_s
                        )
                    except Exception as err:  # noqa: BLE001 - that request fails, not the engine
                        bad = isinstance(err, ValueError)
                        text = str(err) if bad else repr(err)
                        conn.send(RequestRejected(msg.request_id, text, bad))
                elif type(msg) is AbortRequest:
                    out = engine.abort(msg.request_id)
                    if out is not None:
                        outs.append(out)
                elif type(msg) is StopEngine:
                    engine.shutdown()
                    conn.send(EngineStopped())
                    return 0
                else:
                    raise TypeError(f"unexpected message from the parent: {msg!r}")
                timeout = 0.0
            stepped = engine.has_unfinished()
            if stepped:
                if step_sleep_s:
                    time.sleep(step_sleep_s)
                outs.extend(engine.step())
            stats = engine.stats()
            counts = engine.pop_step_token_counts()
            # After every step, even an empty one: the parent's proof of progress.
            kv_events = engine.block_manager.pop_kv_events()
            if stepped or outs or counts or kv_events or stats != last_stats:
                conn.send(StepResult(outs, stats, counts, kv_events))
                last_stats = stats
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # the parent went away: nobody is listening
    except BaseException:  # noqa: BLE001 - the step loop failed: tell the parent, then exit
        log.exception("engine step failed")
        try:
            conn.send(EngineFatal(traceback.format_exc(limit=5)))
        except OSError:
            pass
        return 1


def _test_step_sleep_s() -> float:
    """The test hooks' sleep before each step of this engine (see TEST_STEP_SLEEP_ENV); 0
    unless a test set them."""
    sleep_s = float(os.environ.get(TEST_STEP_SLEEP_ENV) or 0)
    claim = os.environ.get(TEST_STEP_SLEEP_ONCE_ENV)
    if sleep_s and claim:
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return 0.0  # another engine took the hang
        log.warning("test hook: every step of this engine sleeps %g s first", sleep_s)
    return sleep_s


def _exit_when_orphaned(parent: int) -> None:
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() != parent:
            os._exit(0)


def main(argv: list[str]) -> int:
    # Ctrl-C reaches the whole process group; the parent decides when the engine stops
    # (a server drains its requests first).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s engine-process %(message)s"
    )
    threading.Thread(
        target=_exit_when_orphaned, args=(os.getppid(),), name="kvray-orphan-check", daemon=True
    ).start()
    conn = Connection(int(argv[0]))
    try:
        return serve_engine(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
