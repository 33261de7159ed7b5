"""EleutherAI's lm-evaluation-harness against kvray: a small local task (multiple choice, scored
by log-likelihood through echo + logprobs, and generate_until) run with lm_eval's own
transformers backend (`hf`, float32) and with `local-completions` on the shared app's
/v1/completions. Every choice's log-likelihood, the accuracy and every generation agree.

No network: the dataset is JSONL written here, the tokenizer and checkpoint are the demo's
directory, and the Hugging Face libraries run offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.serve_helpers import App

pytestmark = pytest.mark.slow

# Multiple choice: 3 or 4 continuations each, the answer an index.
MC = [
    ("The cat sat on the", [" mat", " moon", " idea"], 0),
    ("Once upon a time there was a", [" king", " table", " seven", " river"], 0),
    ("The train leaves at", [" noon", " purple", " the"], 0),
    ("She opened the door and", [" smiled", " blue", " eleven", " quickly"], 0),
    ("Two plus two is", [" four", " five", " green"], 1),
    ("The old man walked to the", [" village", " number", " sang", " because"], 0),
]
GEN = ["Once upon a time", "The king said", "In the morning the"]
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
"""
MC_TASK = """output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_TASK = """output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: target
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def _write_tasks(root: Path) -> list[str]:
    mc = [{"question": q, "choices": c, "answer": a} for q, c, a in MC]
    gen = [{"prompt": p, "target": "x"} for p in GEN]
    for name, rows, body in (("kvray_mc", mc, MC_TASK), ("kvray_gen", gen, GEN_TASK)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        head = TASK.format(name=name, data=data, cache=root / "datasets")
        (root / f"{name}.yaml").write_text(head + body.format())
    return ["kvray_mc", "kvray_gen"]


@pytest.fixture
def offline_hf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing may be downloaded: the Hugging Face libraries offline, caches under tmp_path."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import datasets.config
    import huggingface_hub.constants

    # Read when the libraries were imported (perhaps by another test): set them here too.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)


def _evaluate(model: str, model_args: dict[str, Any], tasks: list[str], root: Path) -> Any:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(root), include_defaults=False),
        log_samples=True,
        batch_size=4,
        bootstrap_iters=0,
    )


def _by_doc(results: Any, task: str) -> dict[int, Any]:
    return {s["doc_id"]: s for s in results["samples"][task]}


@pytest.mark.usefixtures("offline_hf")
def test_lm_eval_local_completions_equal_transformers(
    kvray_app: App, demo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tasks = _write_tasks(tmp_path)
    hf = _evaluate(
        "hf", {"pretrained": str(demo_dir), "dtype": "float32", "device": "cpu"}, tasks, tmp_path
    )
    # As a user runs it: the key from OPENAI_API_KEY, the checkpoint's tokenizer, token ids sent.
    monkeypatch.setenv("OPENAI_API_KEY", kvray_app.api_key or "")
    served = _evaluate(
        "local-completions",
        {
            "model": kvray_app.model,
            "base_url": f"{kvray_app.base_url}/v1/completions",
            "tokenizer": str(demo_dir),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "max_retries": 1,
        },
        tasks,
        tmp_path,
    )

    hf_mc, kv_mc = _by_doc(hf, "kvray_mc"), _by_doc(served, "kvray_mc")
    assert sorted(kv_mc) == list(range(len(MC)))
    for doc_id, ref in hf_mc.items():
        want = [ll for ll, _ in ref["filtered_resps"]]
        got = [ll for ll, _ in kv_mc[doc_id]["filtered_resps"]]
        assert len(got) == len(MC[doc_id][1])
        assert got == pytest.approx(want, abs=1e-3), doc_id
        assert kv_mc[doc_id]["acc"] == ref["acc"]
    assert served["results"]["kvray_mc"]["acc,none"] == hf["results"]["kvray_mc"]["acc,none"]

    hf_gen, kv_gen = _by_doc(hf, "kvray_gen"), _by_doc(served, "kvray_gen")
    got = [kv_gen[i]["filtered_resps"] for i in range(len(GEN))]
    assert got == [hf_gen[i]["filtered_resps"] for i in range(len(GEN))]
    texts = [t for resps in got for t in (resps if isinstance(resps, list) else [resps])]
    assert len(texts) == len(GEN) and any(t.strip() for t in texts), texts
