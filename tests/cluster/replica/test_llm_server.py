"""LLMServer's pure helpers; the deployment itself is tested through the APIs
(test_openai_api.py, test_grpc_*.py) on a real local Ray."""

from __future__ import annotations

import pytest

from cluster.replica.llm_server import STREAM_MESSAGES_PER_S, chunk_interval_s


def test_a_lone_stream_gets_its_tokens_at_once() -> None:
    # One stream: a few ms at most, well under a decode step, so chunks stay one token each.
    assert chunk_interval_s(1, 50) == pytest.approx(1 / STREAM_MESSAGES_PER_S)
    assert chunk_interval_s(1, 50) < 0.005
    assert chunk_interval_s(0, 50) == 0.0


def test_the_wait_grows_with_streams_up_to_the_cap() -> None:
    waits = [chunk_interval_s(n, 50) for n in (1, 4, 8, 16, 64)]
    assert waits == sorted(waits)
    assert waits[1] == pytest.approx(4 / STREAM_MESSAGES_PER_S)
    assert waits[-1] == 0.05  # 64 streams would want more: the cap holds


def test_cap_zero_sends_every_token_at_once() -> None:
    assert chunk_interval_s(256, 0) == 0.0
