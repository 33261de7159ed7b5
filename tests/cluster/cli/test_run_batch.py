"""`kvray run-batch`, the real command in a child process: a mixed file against the shared
app (--base-url, its key from the variable --api-key-env names), stdin to stdout, a wrong key
refused before the batch, flags that make no sense refused; and without --base-url, the
command starting kvray on its own Ray instance, answering the file and leaving nothing
running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from cluster.cli import run_batch
from cluster.cli.main import main
from cluster.config import ServeConfig
from cluster.deploy.serve_env import LOCAL_PORT_KEYS
from tests.cluster.serve_helpers import API_KEY, API_KEY_ENV, App, free_port

REPO = Path(__file__).resolve().parents[3]
# The installed console script when there is one (what a user runs), else the module.
_SCRIPT = Path(sys.executable).with_name("kvray")
KVRAY = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "cluster.cli.main"]


SHORT = {"prompt": "b", "max_tokens": 1}


def _line(custom_id: str, url: str, body: dict[str, Any], method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def _kvray(*argv: str, stdin: str | None = None, env: dict[str, str] | None = None) -> Any:
    return subprocess.run(
        [*KVRAY, "run-batch", *argv],
        cwd=REPO,
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _records(text: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in text.splitlines()]


@pytest.mark.slow
def test_a_mixed_file_gets_one_result_per_line_in_order(kvray_app: App, tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "Name a river."}]
    lines = [
        _line("cmpl", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24}),
        _line("chat", "/v1/chat/completions", {"messages": chat, "max_tokens": 4}),
        '{"custom_id": "broken", "method": "POST",',
        "",  # blank: no record
        _line("moderation", "/v1/moderations", {"input": "hi"}),
        _line("bad-top-p", "/v1/completions", {"prompt": "x", "top_p": 1.5}),
        _line("embed", "/v1/embeddings", {"input": "hello there"}),
        _line("cmpl", "/v1/completions", {"prompt": "again"}),  # a custom_id used before
        _line("get", "/v1/completions", {"prompt": "x"}, method="GET"),
        _line("resp", "/v1/responses", {"input": "Hi", "max_output_tokens": 4}),
        # Short ones after a long one: they finish first, and are written after it.
        _line("long", "/v1/completions", {"prompt": "a", "max_tokens": 64, "ignore_eos": True}),
        *(_line(f"short-{i}", "/v1/completions", SHORT) for i in range(5)),
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # Last, a line that is not UTF-8: an error record like any bad line.
    src.write_bytes(("\n".join(lines) + "\n").encode() + b'\xff\xfe{"custom_id": "z"}\n')
    env = {**os.environ, API_KEY_ENV: API_KEY}
    done = _kvray(
        "-i", str(src), "-o", str(out), "--base-url", kvray_app.base_url,
        "--api-key-env", API_KEY_ENV, "--max-concurrency", "4", env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = _records(out.read_text())
    ids = [r["custom_id"] for r in records]
    expected = "cmpl chat - moderation bad-top-p embed cmpl get resp long".split()
    expected += [f"short-{i}" for i in range(5)] + ["-"]
    assert ids == [None if x == "-" else x for x in expected]
    for r in records:
        assert list(r) == ["id", "custom_id", "response", "error"] and r["id"].startswith(
            "batch_req_"
        )
        assert (r["response"] is None) != (r["error"] is None), r
    cmpl, chat_r, broken, moderation, bad, embed, dup, get, resp = records[:9]
    assert cmpl["response"]["status_code"] == 200 and cmpl["response"]["request_id"]
    assert cmpl["response"]["body"]["object"] == "text_completion"
    assert cmpl["response"]["body"]["usage"]["completion_tokens"] >= 1
    assert chat_r["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert broken["error"]["code"] == "invalid_json_line"
    assert broken["error"]["message"].startswith("line 3: ")
    assert moderation["error"]["code"] == "invalid_url"
    # The server's 400 is a response, with OpenAI's error body naming the field.
    assert bad["response"]["status_code"] == 400 and bad["error"] is None
    assert bad["response"]["body"]["error"]["param"] == "top_p"
    assert embed["response"]["status_code"] == 200, embed
    vector = embed["response"]["body"]["data"][0]["embedding"]
    assert len(vector) > 8 and all(isinstance(x, float) for x in vector)
    assert dup["error"]["code"] == "duplicate_custom_id"
    assert get["error"]["code"] == "invalid_method"
    assert resp["response"]["status_code"] == 200, resp
    assert resp["response"]["body"]["object"] == "response"
    assert all(r["response"]["status_code"] == 200 for r in records[9:15])
    assert records[9]["response"]["body"]["usage"]["completion_tokens"] == 64
    assert records[15]["error"]["code"] == "invalid_json_line"
    # The progress bar counted every record; the summary adds them up.
    assert "16/16" in done.stderr, done.stderr
    assert "16 request(s): 10 succeeded, 1 answered with an error, 5 not run" in done.stderr


@pytest.mark.slow
def test_stdin_to_stdout_with_the_key_flag(kvray_app: App) -> None:
    lines = [_line(f"r{i}", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}) for i in (0, 1)]
    done = _kvray(
        "-i", "-", "-o", "-", "--base-url", f"{kvray_app.base_url}/v1/", "--api-key", API_KEY,
        stdin="\n".join(lines) + "\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = _records(done.stdout)  # stdout holds the results and nothing else
    assert [r["custom_id"] for r in records] == ["r0", "r1"]
    assert all(r["response"]["status_code"] == 200 for r in records)
    assert "results in stdout" in done.stderr


@pytest.mark.slow
def test_a_wrong_key_stops_before_the_batch(kvray_app: App, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(_line("r", "/v1/completions", {"prompt": "Hi"}) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "KVRAY_API_KEY"}
    done = _kvray("-i", str(src), "-o", str(tmp_path / "out.jsonl"),
                  "--base-url", kvray_app.base_url, "--api-key", "wrong", env=env)  # fmt: skip
    assert done.returncode == 1, done
    assert done.stderr.startswith("kvray run-batch: ") and "answered 401" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    unreachable = _kvray("-i", str(src), "-o", "-", "--base-url", f"http://127.0.0.1:{free_port()}")
    assert unreachable.returncode == 1 and "cannot reach" in unreachable.stderr
    assert unreachable.stdout == ""


def test_flags_that_make_no_sense_are_refused(tmp_path: Path, capsys: Any) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("")
    base = ["run-batch", "-i", str(src)]
    cases = [
        ([*base, "-o", "-", "--base-url", "http://h:1", "--model", "x"], 2, "local server"),
        ([*base, "-o", str(src)], 2, "is the input file too"),
        ([*base, "-o", "-", "--max-concurrency", "0"], 2, "--max-concurrency must be > 0"),
        ([*base, "-o", "-", "--tls-cert", "c.pem", "--tls-key", "k.pem"], 2, "plain HTTP"),
        (["run-batch", "-i", str(tmp_path / "none"), "-o", "-"], 1, "No such file"),
    ]
    for argv, rc, words in cases:
        assert main(argv) == rc, argv
        err = capsys.readouterr().err
        assert err.startswith("kvray run-batch: ") and words in err, (argv, err)
    assert src.read_text() == ""  # refused before the output was opened


def test_locally_enough_requests_fill_every_replicas_sequences() -> None:
    assert run_batch.local_concurrency(ServeConfig.from_flat(max_num_seqs=8, num_replicas=3)) == 24
    assert run_batch.local_concurrency(ServeConfig.from_flat(max_num_seqs=8, max_replicas=5)) == 40


@pytest.mark.slow
def test_without_a_url_it_starts_kvray_answers_and_leaves_nothing_running(tmp_path: Path) -> None:
    """Its own Ray instance (ports of its own, as `kvray serve` would choose them), beside
    the session's one when the whole suite runs in one process."""
    src = tmp_path / "in.jsonl"
    src.write_text(
        _line("a", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4})
        + "\n"
        + _line("b", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
        + "\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in LOCAL_PORT_KEYS}
    env.pop("KVRAY_API_KEY", None)
    proc = subprocess.Popen(
        [*KVRAY, "run-batch", "-i", str(src), "-o", "-", "--kv-cache-memory", "64MiB",
         "--max-num-seqs", "4", "--max-model-len", "256", "--no-progress"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 300  # a hang guard, not a measurement
    while proc.poll() is None and time.monotonic() < deadline:
        try:  # every process it starts: Ray's, the replicas, the engines, HAProxy
            for child in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.5)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    records = _records(stdout)  # Ray's forwarded output went to stderr, not into the results
    assert [r["custom_id"] for r in records] == ["a", "b"], stdout
    assert all(r["response"]["status_code"] == 200 for r in records), records
    assert "kvray.serve: application ready" in stderr and "2 succeeded" in stderr
    assert len(seen) > 3, seen  # it did start Ray here
    time.sleep(1)
    alive = [p for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
