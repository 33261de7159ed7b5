"""kvray.v1 fuzzed: hypothesis-built requests against the shared app's GrpcIngress.

The requests are drawn from the messages' own descriptors (so fields added to the .proto
are fuzzed without touching this file): any subset of fields set, one member of each oneof,
extreme integers, NaN and infinities, empty and odd strings, huge repeated fields within the
message limit, token ids past the vocabulary. Whatever they hold, every call ends within
CALL_TIMEOUT_S (a DEADLINE_EXCEEDED is a hang) with OK or a client's status, never INTERNAL,
UNKNOWN or UNAVAILABLE, and an INVALID_ARGUMENT's details start with the request field it
blames (`sampling.top_p: ...`). Without the API key, or with a wrong one, every call is
UNAUTHENTICATED.

Generation stays cheap: max_tokens and n are capped before a request is sent (n over the
server's max_n is kept: a cheap refusal). Examples are derandomized, the same on every run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cluster.ingress.limits import DEFAULT_LIMITS
from kvray.v1 import llm_pb2, llm_pb2_grpc
from tests.cluster.serve_helpers import App, ServePorts

pytestmark = pytest.mark.slow

CALL_TIMEOUT_S = 60.0  # each call's deadline: a liveness bound, far above any real answer
MAX_TOKENS = 3
MAX_N = 2
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # the server's default grpc_max_message_bytes
FUZZ = settings(
    max_examples=200,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=(Phase.explicit, Phase.generate),  # no shrinking: it would replay many calls
)
# What a call may end with: a client's mistake or a full queue, never the server's failure.
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,  # an unknown model
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # the queue is full
}
FIELD_PATH = re.compile(r"^([a-z_]+)(\[\d+\])?((\.[a-z_]+)(\[\d+\])?)*: ")

# -- values --------------------------------------------------------------------------------

_FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, 0.5, 1.0, -1.0, 2.0, 1e308, -1e308, 5e-324]),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.floats(allow_nan=True, allow_infinity=True),
)


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([lo, hi, 0, 1, 2, 16]), st.integers(lo, hi))


_INTS = {
    FieldDescriptor.TYPE_INT32: _ints(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: _ints(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: _ints(0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: _ints(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: _ints(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: _ints(0, 2**64 - 1),
}
_TOKEN_IDS = st.one_of(st.integers(0, 300), _ints(0, 2**32 - 1))  # a few past the vocabulary
_JSON_TEXTS = st.sampled_from(
    ["", "{}", '{"type": "object"}', '{"type": "string", "maxLength": 2}', "[", "null", "1e999"]
)
# Fields whose meaningful values a uniform draw would rarely hit.
_STRINGS = {
    "role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool", ""]), st.text()),
    "model": st.sampled_from(["", "", "", "no-such-model"]),  # mostly the served one
    "json_schema": st.one_of(_JSON_TEXTS, st.text()),
    "parameters_json": st.one_of(_JSON_TEXTS, st.text()),
    "arguments": st.one_of(_JSON_TEXTS, st.text()),
    "regex": st.one_of(st.sampled_from(["[a-z]{1,3}", "(", "a*", ""]), st.text(max_size=8)),
    "text": st.one_of(
        st.text(max_size=64),
        # A long prompt, still within the message limit: refused past max_model_len.
        st.sampled_from([1000, 200_000]).map(lambda k: "ab " * k),
    ),
}
_HUGE_ID_LISTS = st.sampled_from([10_000, 500_000]).map(lambda k: [7] * k)  # 500k ids < 4 MiB
_HUGE_STRING_LISTS = st.sampled_from([1_000, 100_000]).map(lambda k: ["x"] * k)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return _FLOATS
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(numbers), st.integers(-5, 100))  # unknown values too
    if t == FieldDescriptor.TYPE_STRING:
        return _STRINGS.get(field.name, st.text(max_size=32))
    if t in _INTS:
        return _TOKEN_IDS if "id" in field.name else _INTS[t]
    raise AssertionError(f"no strategy for {field.full_name} (type {t})")


def _field_value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        one = messages(field.message_type, depth + 1)
    else:
        one = _scalar(field)
    if not _repeated(field):
        return one
    small = st.lists(one, max_size=4)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return small
    huge = _HUGE_STRING_LISTS if field.type == FieldDescriptor.TYPE_STRING else _HUGE_ID_LISTS
    return st.one_of(small, huge)


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """Messages of `descriptor`'s type: any subset of fields set, at most one member of each
    oneof (proto3 `optional` fields are set or not, like the rest)."""
    cls = _message_class(descriptor)
    oneofs = [o for o in descriptor.oneofs if not _synthetic(o)]
    in_oneof = {f.name for o in oneofs for f in o.fields}
    plain = [f for f in descriptor.fields if f.name not in in_oneof]

    @st.composite
    def build(draw: Any) -> Any:
        msg = cls()
        for oneof in oneofs:
            chosen = draw(st.sampled_from([None, *oneof.fields]))
            if chosen is not None:
                _set(msg, chosen, draw(_field_value(chosen, depth)))
        for f in plain:
            if depth < 3 and draw(st.booleans()):
                _set(msg, f, draw(_field_value(f, depth)))
        return msg

    return build()


def _synthetic(oneof: Any) -> bool:  # the oneof protoc makes for a proto3 `optional` field
    synthetic = getattr(oneof, "is_synthetic", None)
    if synthetic is not None:
        return bool(synthetic)
    return len(oneof.fields) == 1 and oneof.name == f"_{oneof.fields[0].name}"


def _message_class(descriptor: Descriptor) -> Any:
    return getattr(llm_pb2, descriptor.name)


def _repeated(field: FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 6 (label is gone)
    if repeated is not None:
        return bool(repeated)
    return field.label == FieldDescriptor.LABEL_REPEATED


def _set(msg: Any, field: FieldDescriptor, value: Any) -> None:
    if _repeated(field):
        getattr(msg, field.name).extend(value)
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)


def cap_cost(req: llm_pb2.GenerateRequest) -> llm_pb2.GenerateRequest:
    """At most MAX_TOKENS tokens (chat's default is the whole context) and MAX_N
    completions; an n over the server's max_n is kept (a cheap refusal)."""
    sp = req.sampling
    if not sp.HasField("max_tokens") or sp.max_tokens > MAX_TOKENS:
        sp.max_tokens = MAX_TOKENS
    if sp.HasField("n") and MAX_N < sp.n <= DEFAULT_LIMITS.max_n:
        sp.n = MAX_N
    return req


GENERATE = messages(llm_pb2.GenerateRequest.DESCRIPTOR).map(cap_cost)
TOKENIZE = messages(llm_pb2.TokenizeRequest.DESCRIPTOR)

# -- the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stub(kvray_app: App, serve_ports: ServePorts) -> Iterator[Any]:
    # The shared app's GrpcIngress listens on Serve's gRPC port.
    options = [("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]
    with grpc.insecure_channel(f"127.0.0.1:{serve_ports.grpc}", options=options) as channel:
        s = llm_pb2_grpc.LLMServiceStub(channel)
        s.ListModels(  # waits until the gRPC ingress serves
            llm_pb2.ListModelsRequest(),
            metadata=_auth(kvray_app.api_key),
            timeout=300,
            wait_for_ready=True,
        )
        yield s


def _auth(key: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")] if key else []


def call(method: Any, request: Any, key: str | None) -> tuple[grpc.StatusCode, str]:
    """The status a call ends with (a stream is read to its end)."""
    try:
        result = method(request, metadata=_auth(key), timeout=CALL_TIMEOUT_S)
        if not hasattr(result, "ByteSize"):  # a response stream
            for _ in result:
                pass
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def check_status(request: Any, code: grpc.StatusCode, details: str) -> None:
    assert code in ALLOWED, (code, details[:300], _short(request))
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        match = FIELD_PATH.match(details)
        assert match, (details[:300], _short(request))
        root = match.group(1)
        names = {f.name for f in request.DESCRIPTOR.fields} | {
            o.name for o in request.DESCRIPTOR.oneofs
        }
        assert root in names, (details[:300], _short(request))


def _short(request: Any) -> str:
    text = str(request)
    return text if len(text) < 600 else f"{text[:600]}... ({request.ByteSize()} bytes)"


# -- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
def test_fuzzed_generate(stub: Any, kvray_app: App, rpc: str) -> None:
    codes: list[grpc.StatusCode] = []

    @FUZZ
    @given(request=GENERATE)
    def fuzz(request: llm_pb2.GenerateRequest) -> None:
        code, details = call(getattr(stub, rpc), request, kvray_app.api_key)
        codes.append(code)
        check_status(request, code, details)

    fuzz()
    # The fuzzer reached the engine too, not only the checks in front of it.
    assert grpc.StatusCode.OK in codes, codes


@FUZZ
@given(request=TOKENIZE)
def test_fuzzed_tokenize(stub: Any, kvray_app: App, request: llm_pb2.TokenizeRequest) -> None:
    code, details = call(stub.Tokenize, request, kvray_app.api_key)
    check_status(request, code, details)


@settings(FUZZ, max_examples=10)
@given(
    rpc=st.sampled_from(["Generate", "GenerateStream", "Tokenize", "ListModels"]),
    key=st.sampled_from([None, "", "wrong-key", "Bearer"]),
    data=st.data(),
)
def test_fuzzed_calls_without_the_key(stub: Any, rpc: str, key: str | None, data: Any) -> None:
    strategy = {
        "Generate": GENERATE,
        "GenerateStream": GENERATE,
        "Tokenize": TOKENIZE,
        "ListModels": st.just(llm_pb2.ListModelsRequest()),
    }[rpc]
    request = data.draw(strategy)
    code, details = call(getattr(stub, rpc), request, key)
    assert code is grpc.StatusCode.UNAUTHENTICATED, (rpc, code, details)
