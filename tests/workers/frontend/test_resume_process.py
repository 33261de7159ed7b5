"""Resumption across engine processes: a resumed input crosses the pipe to the engine child
whole, and a stream whose engine process is killed mid-way goes on in another process with the
client seeing the undisturbed stream (test_resume.py covers the engine's side in process)."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
from pathlib import Path

import pytest

from tests.workers.frontend.test_resume import PROMPT, _client_view
from workers import AsyncEngine, SamplingParams
from workers.config import EngineArgs
from workers.errors import EngineDeadError
from workers.frontend.resume import ResumeTracker
from workers.inputs import InputChecker, ResumedSample
from workers.messages.core import AddRequest
from workers.outputs import RequestOutput


def test_a_resumed_input_crosses_to_the_engine_process_whole() -> None:
    checker = InputChecker(vocab_size=100, max_model_len=64)
    inp = checker.check([1, 2, 3], SamplingParams(n=2, max_tokens=8, logprobs=1))
    sample = ResumedSample(1, (4, 5), 2, ({4: -0.5}, {5: -0.25, 6: -2.0}))
    msg = AddRequest("r", checker.check_resume(inp, [sample]), 0.0)
    back = pickle.loads(pickle.dumps(msg))
    assert back == msg and back.input.resume == (sample,)


def test_engine_process_killed_mid_stream_resumes_on_another(demo_dir: Path) -> None:
    """The real failure: the engine's child process dies (SIGKILL) while streaming; the
    request goes on in another engine process and the client's stream is the undisturbed one."""
    args = EngineArgs(model=str(demo_dir), kv_cache_memory_bytes=16 << 20)
    dying, spare = AsyncEngine(args, process=True), AsyncEngine(args, process=True)
    params = SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=17, max_tokens=40, logprobs=2)
    inp = spare.input_checker.check_prompt(PROMPT, params, spare.tokenizer)

    async def main() -> tuple[list[RequestOutput], list[RequestOutput], ResumeTracker]:
        expected = [o async for o in spare.generate_input(inp, "undisturbed")]
        tracker = ResumeTracker(inp, spare.input_checker)
        seen: list[RequestOutput] = []
        with pytest.raises(EngineDeadError):
            async for out in dying.generate_input(inp, "first"):
                seen.append(tracker.observe(out))
                if len(seen) == 10:
                    os.kill(dying._core.pid, signal.SIGKILL)
        nxt = tracker.resume_input()
        assert nxt is not None and nxt.resume
        seen += [tracker.observe(o) async for o in spare.generate_input(nxt, "resumed")]
        return expected, seen, tracker

    try:
        expected, seen, tracker = asyncio.run(main())
    finally:
        dying.shutdown()
        spare.shutdown()
    assert _client_view(seen) == _client_view(expected)
    assert tracker.attempts == 2 and tracker.tokens_observed == 80
