"""`kvray generate` over a GGUF file: its embedded tokenizer, or one named by --tokenizer when
it embeds none (the error says so otherwise)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cluster.cli import generate
from tests.gguf_checkpoints import make_gguf


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_generate_serves_a_gguf_file_and_takes_a_tokenizer_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from workers.demo import demo_model_dir

    bare = make_gguf(tmp_path / "bare.gguf", "qwen3", "Q8_0", tokenizer=False)
    assert generate.run(_args("--model", str(bare), "--max-tokens", "4", "Hello")) == 2
    assert "embeds no tokenizer" in capsys.readouterr().err
    argv = ("--model", str(bare), "--tokenizer", str(demo_model_dir()), "--max-tokens", "4")
    assert generate.run(_args(*argv, "--ignore-eos", "Hello")) == 0
    assert capsys.readouterr().out.strip()
    own = make_gguf(tmp_path / "own.gguf", "llama", "Q4_K")
    assert generate.run(_args("--model", str(own), "--max-tokens", "4", "--ignore-eos", "Hi")) == 0
    assert capsys.readouterr().out.strip()
