"""The engine parent <-> child messages: frozen, slotted, and unchanged across a real socket."""

from __future__ import annotations

import dataclasses
import typing
from multiprocessing import Pipe

import pytest

from workers.config import EngineArgs
from workers.core.stats import EngineStats
from workers.inputs import EngineInput, InputChecker
from workers.messages import core as m
from workers.outputs import CompletionOutput, RequestMetrics, RequestOutput
from workers.sampling_params import SamplingParams

OUT = RequestOutput(
    request_id="r1",
    prompt=None,
    prompt_token_ids=[],
    outputs=[CompletionOutput(index=0, delta_text="hi", delta_token_ids=[7, 8])],
)
FINAL = RequestOutput(
    request_id="r2",
    prompt="p",
    prompt_token_ids=[1, 2],
    outputs=[CompletionOutput(index=0, text="x", token_ids=[3], finish_reason="stop")],
    finished=True,
    metrics=RequestMetrics(arrival_time=1.0, finished_time=2.0),
)


def _examples(demo_dir) -> list[object]:  # noqa: ANN001
    config = EngineArgs(model=str(demo_dir)).create_config()
    inp = EngineInput((1, 2, 3), SamplingParams(max_tokens=4, stop=["x"]), "text")
    return [
        m.StartEngine(config),
        m.AddRequest("r1", inp, 12.5),
        m.AbortRequest("r1"),
        m.StopEngine(),
        m.EngineReady(128, InputChecker(vocab_size=4096, max_model_len=2048, kv_cache_tokens=2048)),
        m.StepResult([OUT, FINAL], EngineStats(num_steps=3), [5, 1]),
        m.RequestRejected("r1", "request_id 'r1' is already in use", True),
        m.EngineFatal("Traceback ..."),
        m.EngineStopped(),
    ]


def test_every_message_kind_has_an_example(demo_dir) -> None:  # noqa: ANN001
    kinds = set(typing.get_args(m.ToChild)) | set(typing.get_args(m.ToParent))
    assert {type(msg) for msg in _examples(demo_dir)} == kinds


def test_messages_cross_a_socket_unchanged(demo_dir) -> None:  # noqa: ANN001
    parent, child = Pipe()
    with parent, child:
        for msg in _examples(demo_dir):
            parent.send(msg)
            got = child.recv()
            assert type(got) is type(msg) and got == msg


@pytest.mark.parametrize(
    "cls", sorted(set(typing.get_args(m.ToChild)) | set(typing.get_args(m.ToParent)), key=str)
)
def test_messages_are_frozen_slotted_dataclasses(cls: type) -> None:
    assert dataclasses.is_dataclass(cls)
    assert cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert "__slots__" in cls.__dict__  # no per-message __dict__ to pickle
