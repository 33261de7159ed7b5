"""The public gRPC API definition: buf lint, checked-in stubs up to date, service shape."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.grpc_api import protogen

REPO = Path(__file__).resolve().parents[3]


def _buf() -> str:
    # buf-bin installs `buf` next to the interpreter; fall back to PATH (npm's @bufbuild/buf).
    here = Path(sys.executable).with_name("buf")
    found = str(here) if here.exists() else shutil.which("buf")
    if found is None:
        pytest.skip("buf is not installed (pip install buf-bin)")
    return found


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_buf(), "lint"], cwd=root, capture_output=True, text=True, timeout=120, check=False
    )


def test_buf_lint_is_clean() -> None:
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_lint_rejects_an_undocumented_field(tmp_path: Path) -> None:
    # The same config on a copy with one comment removed must fail: the lint really runs
    # over proto/ with the COMMENTS rules on.
    shutil.copy(REPO / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(REPO / "proto", tmp_path / "proto", ignore=shutil.ignore_patterns("*.py*"))
    proto = tmp_path / "proto/kvray/v1/llm.proto"
    text = proto.read_text()
    doc = "  // The token's id.\n  uint32 token_id = 1;\n"
    assert doc in text
    proto.write_text(text.replace(doc, "  uint32 token_id = 1;\n", 1))
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "COMMENT" in result.stdout + result.stderr or "comment" in result.stdout


def test_checked_in_stubs_match_the_proto() -> None:
    stale = protogen.stale_files()
    assert not stale, f"stale stubs {stale}: run `python -m cluster.grpc_api.protogen`"


def test_a_proto_change_makes_the_stubs_stale(tmp_path: Path) -> None:
    shutil.copytree(REPO / "proto", tmp_path / "proto")
    proto = tmp_path / "proto/kvray/v1/llm.proto"
    proto.write_text(
        proto.read_text().replace(
            "message ListModelsRequest {}",
            "message ListModelsRequest {\n  // A new field.\n  string owner = 1;\n}",
        )
    )
    stale = {p.name for p in protogen.stale_files(tmp_path / "proto")}
    assert "llm_pb2.py" in stale


def test_service_shape() -> None:
    from kvray.v1 import llm_pb2, llm_pb2_grpc

    fd = llm_pb2.DESCRIPTOR
    assert fd.package == "kvray.v1"
    service = fd.services_by_name["LLMService"]
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {
        "Generate",
        "GenerateStream",
        "Tokenize",
        "ListModels",
        "Embed",
        "LoadLoraAdapter",
        "UnloadLoraAdapter",
    }
    assert not methods["Embed"].server_streaming
    assert not methods["Generate"].server_streaming
    assert methods["GenerateStream"].server_streaming
    assert methods["GenerateStream"].input_type is methods["Generate"].input_type
    oneof = llm_pb2.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"]
    assert {f.name for f in oneof.fields} == {"text", "token_ids", "chat"}
    assert hasattr(llm_pb2_grpc, "add_LLMServiceServicer_to_server")


def test_sampling_fields_cover_the_http_api() -> None:
    # Every sampling option the OpenAI-compatible HTTP API accepts has a gRPC field.
    from cluster.http.protocol import ChatCompletionRequest, CompletionRequest
    from kvray.v1 import llm_pb2

    grpc_fields = {f.name for f in llm_pb2.SamplingParams.DESCRIPTOR.fields}
    http = CompletionRequest(prompt="x").sampling_kwargs().keys()
    http |= (
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).sampling_kwargs().keys()
    )
    # logprobs is its own message (LogprobsOptions) in the gRPC request, prompt_logprobs a
    # field of the request (its answer is the response's, not a completion's).
    assert set(http) - {"logprobs", "prompt_logprobs"} <= grpc_fields
    assert {"logprobs", "prompt_logprobs"} <= set(llm_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)


def test_reasoning_fields_and_their_numbers() -> None:
    # Field numbers are the wire contract: added after the existing ones, never renumbered.
    from kvray.v1 import llm_pb2

    chat = llm_pb2.ChatMessages.DESCRIPTOR.fields_by_name
    assert chat["chat_template_kwargs_json"].number == 5
    assert chat["thinking_token_budget"].number == 6
    assert chat["thinking_token_budget"].has_presence  # unset differs from a budget of 0
    assert llm_pb2.Completion.DESCRIPTOR.fields_by_name["reasoning"].number == 9
