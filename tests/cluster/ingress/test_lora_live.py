"""LoRA adapters through a real deployment: one app serving the demo model with two adapters
from its config and runtime loading on, its HTTP ingress (the official openai client) and its
own gRPC ingress (real grpcio) sharing one adapter registry.

- `model` resolves in every route (completions, chat, streams, responses, embeddings,
  tokenize; gRPC Generate, Tokenize, Embed): answers echo the adapter's name, the engine runs
  the adapter (its greedy text differs from the base model's, its id is in the engine's
  slots, and both APIs give the same text), an unknown name is 404 / NOT_FOUND;
- /v1/models and ListModels list the adapters after the base model (parent, root);
- a load through one ingress is served by the other at once; a bad adapter, a taken name or
  a missing field is a 400 / INVALID_ARGUMENT / ALREADY_EXISTS naming it; an unload stops new
  requests (404) while a running stream finishes under the adapter; a reload gets a new id;
- `kvray run-batch` lines naming an adapter are answered by it.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from cluster.config import ServeConfig
from cluster.grpc_api.client import KvrayClient, completion_text
from cluster.ingress.lora_registry import static_id
from tests.cluster.grpc_api.grpc_helpers import rpc_status, wait_serving
from tests.cluster.serve_helpers import (
    API_KEY,
    API_KEY_ENV,
    KV_CACHE_BYTES,
    TEST_GRPC_DRAIN_S,
    App,
    ServePorts,
    free_port,
    openai_client,
    replica_stats,
    wait_for,
)

pytestmark = pytest.mark.slow

APP_NAME = "kvray-lora"
PROMPT = "Once upon a time"
GREEDY = {"max_tokens": 8, "temperature": 0.0}
TIMEOUT_S = 120.0  # hang guard


@dataclass(frozen=True)
class LoraApp(App):
    grpc: str = ""  # host:port of the app's own gRPC ingress
    adapters: tuple[str, ...] = ()  # the paths of the config's adapters a, b
    bad: str = ""  # an adapter the engines cannot serve (DoRA)


@pytest.fixture(scope="module")
def app(
    serve_ports: ServePorts, demo_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LoraApp]:
    from ray import serve

    from cluster.deploy.app import ingress_options, llm_server_options
    from cluster.grpc_api.ingress import GrpcSettings, bind_grpc_ingress
    from cluster.http.ingress import OpenAIIngress
    from cluster.ingress.lora_registry import delete_registry
    from cluster.replica.llm_server import LLMServer
    from tests.workers.lora.adapters import write_random_adapter

    root = tmp_path_factory.mktemp("lora")
    paths = [str(write_random_adapter(demo_dir, root / n, seed=s)) for n, s in (("a", 1), ("b", 2))]
    bad = root / "dora"
    shutil.copytree(paths[0], bad)
    adapter_config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**adapter_config, "use_dora": True}))
    config = ServeConfig.from_flat(
        grpc_drain_s=TEST_GRPC_DRAIN_S,
        num_replicas=1,
        api_key_env=API_KEY_ENV,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_num_seqs=8,
        lora_modules=[f"a={paths[0]}", f"b={paths[1]}"],
        max_lora_rank=16,
        enable_runtime_lora=True,
    )
    # build_app's application, with a gRPC port of its own (the other apps' gRPC ingresses
    # share Serve's, and would answer half of the calls).
    llm = serve.deployment(LLMServer, **llm_server_options(config)).bind(config)
    grpc_port = free_port()
    settings = GrpcSettings.from_config(config, host="127.0.0.1", port=grpc_port)
    grpc_node = bind_grpc_ingress(config, llm, settings)
    ingress = serve.deployment(OpenAIIngress, **ingress_options(config))
    serve.run(ingress.bind(config, llm, grpc_node), name=APP_NAME, route_prefix="/lora")
    wait_serving(grpc_port)
    base = f"http://127.0.0.1:{serve_ports.http}/lora"
    target = f"127.0.0.1:{grpc_port}"
    try:
        yield LoraApp(
            APP_NAME, base, config.engine.model_name(), API_KEY, target, tuple(paths), str(bad)
        )
    finally:
        serve.delete(APP_NAME)
        delete_registry(APP_NAME)


@pytest.fixture(scope="module")
def client(app: LoraApp) -> openai.OpenAI:
    return openai_client(app)


@pytest.fixture(scope="module")
def rpc(app: LoraApp) -> Iterator[KvrayClient]:
    with KvrayClient(app.grpc, API_KEY, timeout=TIMEOUT_S) as c:
        yield c


def _post(app: App, path: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{app.base_url}{path}", json=body, headers=headers, timeout=TIMEOUT_S)


def _load(app: App, name: str, path: str) -> int:
    r = _post(app, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    assert r.status_code == 200 and r.text.startswith("Success"), r.text
    match = re.search(r"\(id (\d+)\)", r.text)
    assert match, r.text
    return int(match.group(1))


def _refused(r: httpx.Response, status: int, param: str | None, words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_models_list_the_adapters_after_the_base_model(
    app: LoraApp, client: openai.OpenAI, rpc: KvrayClient
) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [app.model, "a", "b"]
    assert models[0].model_extra["parent"] is None and models[0].model_extra["root"] == app.model
    for m, path in zip(models[1:], app.adapters, strict=True):
        assert m.model_extra["parent"] == app.model and m.model_extra["root"] == path
        assert m.model_extra["max_model_len"] == models[0].model_extra["max_model_len"]
    listed = rpc.list_models()
    assert [(m.id, m.parent, m.root) for m in listed] == [
        (app.model, "", app.model),
        ("a", app.model, app.adapters[0]),
        ("b", app.model, app.adapters[1]),
    ]


def test_requests_run_under_the_adapter_they_name(
    app: LoraApp, client: openai.OpenAI, rpc: KvrayClient
) -> None:
    base = client.completions.create(model=app.model, prompt=PROMPT, **GREEDY)
    a = client.completions.create(model="a", prompt=PROMPT, **GREEDY)
    assert (base.model, a.model) == (app.model, "a")
    assert a.choices[0].text != base.choices[0].text  # the engine ran the adapter
    engine = replica_stats(app, 1)
    a_id = static_id("a", app.adapters[0])  # a config adapter's id: its name and path
    assert a_id in next(iter(engine.values()))["lora_adapters"]  # in a device slot
    chat = client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert chat.model == "b"
    stream = client.completions.create(model="a", prompt=PROMPT, stream=True, **GREEDY)
    chunks = list(stream)
    assert {c.model for c in chunks} == {"a"}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == a.choices[0].text
    assert client.responses.create(model="b", input="Hi", max_output_tokens=4).model == "b"
    embedding = client.embeddings.create(model="a", input=PROMPT, encoding_format="float")
    plain = client.embeddings.create(model=app.model, input=PROMPT, encoding_format="float")
    assert embedding.model == "a" and embedding.data[0].embedding != plain.data[0].embedding
    assert _post(app, "/tokenize", {"model": "b", "prompt": PROMPT}).status_code == 200
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=1)
    assert err.value.body["param"] == "model"
    # gRPC: the same adapter, the same greedy text; the same refusal.
    resp = rpc.generate(PROMPT, model="a", max_tokens=8, temperature=0.0)
    assert resp.model == "a" and completion_text(resp) == a.choices[0].text
    assert rpc.embed(PROMPT, model="b").model == "b"
    assert rpc.tokenize(PROMPT, model="a") == rpc.tokenize(PROMPT)
    code, _ = rpc_status(lambda: rpc.generate(PROMPT, model="nope", max_tokens=1))
    assert code is grpc.StatusCode.NOT_FOUND


def test_load_and_unload_at_run_time(app: LoraApp, client: openai.OpenAI, rpc: KvrayClient) -> None:
    # Loaded over HTTP, served over gRPC at once (the other ingress asks the registry).
    first = _load(app, "c", app.adapters[0])
    assert first > 2  # above the config's adapters' ids
    assert [m.id for m in rpc.list_models()][-1] == "c"
    via_a = client.completions.create(model="a", prompt=PROMPT, **GREEDY).choices[0].text
    assert completion_text(rpc.generate(PROMPT, model="c", max_tokens=8, temperature=0.0)) == via_a

    _refused(
        _post(app, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": app.adapters[1]}),
        400,
        "lora_name",
        "already loaded",
    )
    _refused(_post(app, "/v1/load_lora_adapter", {"lora_name": "d"}), 400, "lora_path", "")
    _refused(
        _post(app, "/v1/load_lora_adapter", {"lora_name": app.model, "lora_path": app.bad}),
        400,
        "lora_name",
        "served model",
    )
    _refused(
        _post(app, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": app.bad}),
        400,
        "lora_path",
        "use_dora",  # the adapter check's words: its file and field
    )
    _refused(
        _post(app, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": "rel/d"}),
        400,
        "lora_path",
        "absolute",
    )
    r = _post(app, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": app.adapters[0]}, None)
    assert r.status_code == 401
    assert [m.id for m in client.models.list().data] == [app.model, "a", "b", "c"]  # unchanged

    r = _post(app, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert r.status_code == 200 and r.text.startswith("Success"), r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt=PROMPT, max_tokens=1)
    _refused(_post(app, "/v1/unload_lora_adapter", {"lora_name": "c"}), 404, "lora_name", "")
    assert _load(app, "c", app.adapters[1]) > first  # a new id: never one given before

    # gRPC's own load and unload, seen over HTTP.
    model = rpc.load_lora_adapter("d", app.adapters[1])
    assert (model.id, model.parent, model.root) == ("d", app.model, app.adapters[1])
    assert "d" in [m.id for m in client.models.list().data]
    code, _ = rpc_status(lambda: rpc.load_lora_adapter("d", app.adapters[0]))
    assert code is grpc.StatusCode.ALREADY_EXISTS
    code, details = rpc_status(lambda: rpc.load_lora_adapter("e", app.bad))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith("lora_path: ")
    code, _ = rpc_status(lambda: rpc.unload_lora_adapter("nope"))
    assert code is grpc.StatusCode.NOT_FOUND
    rpc.unload_lora_adapter("d")
    rpc.unload_lora_adapter("a")  # a static adapter, too
    wait_for(  # the HTTP ingress's cache: within a second (a hang guard, not a latency bound)
        lambda: [m.id for m in client.models.list().data] == [app.model, "b", "c"],
        "the HTTP ingress to see the unloads",
    )


def test_a_running_stream_finishes_under_an_unloaded_adapter(
    app: LoraApp, client: openai.OpenAI
) -> None:
    _load(app, "e", app.adapters[1])
    stream = client.completions.create(
        model="e", prompt=PROMPT, stream=True, max_tokens=48, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    first = next(chunks)
    r = _post(app, "/v1/unload_lora_adapter", {"lora_name": "e"})
    assert r.status_code == 200, r.text
    rest = list(chunks)
    done = [c for c in [first, *rest] if c.choices and c.choices[0].finish_reason]
    assert done and done[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="e", prompt=PROMPT, max_tokens=1)


def test_run_batch_lines_name_adapters(app: LoraApp) -> None:
    from cluster.cli.batch_file import numbered_lines
    from cluster.cli.batch_runner import RunOptions, run_lines

    lines = [
        {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"model": "b"}},
        {"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"model": "x"}},
    ]
    for line in lines:
        line["body"] |= {"prompt": PROMPT, "max_tokens": 4}
    out = io.StringIO()
    options = RunOptions(app.base_url, API_KEY, progress=False)
    asyncio.run(run_lines(numbered_lines(json.dumps(x) for x in lines), out, options))
    records = {r["custom_id"]: r["response"] for r in map(json.loads, out.getvalue().splitlines())}
    assert records["b"]["status_code"] == 200 and records["b"]["body"]["model"] == "b"
    assert records["x"]["status_code"] == 404
