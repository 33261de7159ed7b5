"""Prompt logprobs and embeddings (workers/device/scoring.py) against transformers in float32.

Every forward path: the CPU kernels, torch's ops, and chunked prefill (a prompt over several
steps). Each prompt runs twice, the second time with its blocks in the prefix cache, which
such requests must not use for what they compute.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from workers import LLM
from workers.outputs import RequestOutputKind
from workers.pooling import Pooling
from workers.sampling_params import SamplingParams

PROMPTS = [list(range(5, 45)), [100, 101, 102], [7] * 70, [42]]
PATHS = {
    "kernels": {},
    "torch": {"cpu_kernels": False},
    "chunked": {"max_num_batched_tokens": 16},
}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def hf(checkpoints: dict[str, Path], kind: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoints[kind], dtype=torch.float32).eval()


def make_llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=16 << 20, **kwargs)


def hf_prompt_logprobs(hf: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def hf_embedding(hf: Any, prompt: list[int], kind: str) -> torch.Tensor:
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    h = out.hidden_states[-1][0]  # after the final norm, as AutoModel's last_hidden_state
    return torch.nn.functional.normalize(h[-1] if kind == "last" else h.mean(0), dim=0)


@pytest.mark.parametrize("path", PATHS)
def test_prompt_logprobs_and_embeddings_equal_transformers(
    checkpoints: dict[str, Path], kind: str, hf: Any, path: str
) -> None:
    llm = make_llm(checkpoints[kind], **PATHS[path])
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    refs = [hf_prompt_logprobs(hf, p) for p in PROMPTS]
    for _ in range(2):  # the second pass finds every prompt's blocks cached
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for prompt, out, ref in zip(PROMPTS, outs, refs, strict=True):
            lps = out.prompt_logprobs
            assert lps is not None and len(lps) == len(prompt) and lps[0] is None
            assert out.num_cached_tokens == 0
            for i in range(1, len(prompt)):
                top = ref[i - 1].topk(3)
                want = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                want[prompt[i]] = ref[i - 1, prompt[i]].item()
                assert lps[i].keys() == want.keys(), (i, lps[i], want)
                for t, v in want.items():
                    assert lps[i][t] == pytest.approx(v, abs=1e-4), (i, t)
    for pooling in ("last", "mean"):
        for _ in range(2):
            outs = llm.embed(PROMPTS, Pooling(pooling), use_tqdm=False)
            for prompt, out in zip(PROMPTS, outs, strict=True):
                want = hf_embedding(hf, prompt, pooling)
                assert out.embedding is not None and len(out.embedding) == want.numel()
                torch.testing.assert_close(torch.tensor(out.embedding), want, atol=1e-4, rtol=0)
                assert out.outputs[0].finish_reason == "stop" and not out.outputs[0].token_ids
    assert llm.engine.block_manager.num_used_blocks == 0  # every block came back


def test_scoring_requests_in_the_engine(checkpoints: dict[str, Path]) -> None:
    """The first of n samples scores the prompt; a streamed request gets the prompt logprobs
    once, in its first output after the prompt; an embedding request may fill max_model_len;
    unnormalised pooling is the raw hidden state."""
    llm = make_llm(checkpoints["llama"], max_model_len=64)
    prompt = list(range(3, 20))
    n2 = llm.generate(prompt, SamplingParams(n=2, max_tokens=3, prompt_logprobs=0, seed=1))[0]
    assert len(n2.prompt_logprobs) == len(prompt)
    assert all(len(e) == 1 and prompt[i] in e for i, e in enumerate(n2.prompt_logprobs[1:], 1))
    # The first token ends the request in the step that scores the prompt's last chunk.
    one = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
    assert one.prompt_logprobs == n2.prompt_logprobs

    engine = llm.engine
    streamed = SamplingParams(max_tokens=4, prompt_logprobs=1, temperature=0)
    engine.add_prompt("s", prompt, streamed)
    outs: list[Any] = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert streamed.output_kind is RequestOutputKind.DELTA
    running = [o.prompt_logprobs for o in outs if not o.finished]
    assert running[0] is not None and len(running[0]) == len(prompt)
    for i in range(1, len(prompt)):
        assert prompt[i] in running[0][i]
        assert running[0][i][prompt[i]] == pytest.approx(n2.prompt_logprobs[i][prompt[i]])
    assert all(p is None for p in running[1:])
    assert outs[-1].finished and outs[-1].prompt_logprobs == running[0]

    full = llm.embed([list(range(64))], use_tqdm=False)[0]
    assert len(full.embedding) == llm.engine.config.model.hidden_size
    with pytest.raises(ValueError, match="prompt is 65 tokens, over max_model_len"):
        llm.embed([list(range(65))], use_tqdm=False)
    raw = llm.embed([prompt], Pooling(normalize=False), use_tqdm=False)[0].embedding
    normed = llm.embed([prompt], use_tqdm=False)[0].embedding
    norm = torch.tensor(raw).norm().item()
    assert norm != pytest.approx(1.0)
    torch.testing.assert_close(torch.tensor(raw) / norm, torch.tensor(normed))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"pooling": "mean"}, "pooling"),
        ({"pooling": Pooling(), "n": 2}, "n"),
    ],
)
def test_bad_scoring_params_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_pooling_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="pooling must be one of last, mean"):
        Pooling("cls")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="normalize must be a boolean"):
        Pooling(normalize=1)  # type: ignore[arg-type]
