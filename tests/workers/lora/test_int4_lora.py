"""LoRA adapters on int4 W4A16 projections (workers/device/layers/int4_linear.py adds the
delta on top of its product, as the FP8 and int8 layers do): greedy outputs of a GPTQ and an
AWQ checkpoint under adapters equal transformers with peft's adapter merged into the
checkpoint's full-precision twin (the float32 weights the int4 file encodes:
tests/gptq_awq_checkpoints.py), in a batch that mixes the base model and two adapters."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.checkpoints import hf_greedy
from tests.gptq_awq_checkpoints import make_int4_checkpoint
from tests.workers.lora.adapters import merged_hf_model, write_random_adapter
from tests.workers.parity import assert_greedy_match
from workers import LLM, SamplingParams
from workers.lora import LoRARequest

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_adapters_on_int4_projections_match_the_merged_twin(kind: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = make_int4_checkpoint(kind, tmp_path / kind)
    twin = path.with_name(path.name + "-twin")
    adapters = {
        "a1": write_random_adapter(twin, tmp_path / "a1", rank=8, seed=1),
        "a2": write_random_adapter(twin, tmp_path / "a2", rank=4, alpha=8, seed=2),
    }
    rng = random.Random(3)
    prompts, names = [], []
    for n in (1, 7, 23):
        p = [rng.randrange(3, 3800) for _ in range(n)]
        for name in (None, "a1", "a2"):
            prompts.append(p)
            names.append(name)
    llm = LLM(str(path), enable_lora=True, max_lora_rank=8, kv_cache_memory_bytes=16 << 20)
    try:
        loras = [None if n is None else LoRARequest(n, int(n[1]), str(adapters[n])) for n in names]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    finally:
        llm.engine.shutdown()
    oracles = {None: AutoModelForCausalLM.from_pretrained(str(twin), dtype=torch.float32).eval()}
    oracles.update({n: merged_hf_model(twin, a) for n, a in adapters.items()})
    differs = 0
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        hf = oracles[name]
        ours = list(out.outputs[0].token_ids)
        assert_greedy_match(hf, prompt, ours, hf_greedy(hf, prompt, MAX_TOKENS))
        base = outs[names.index(None, prompts.index(prompt))].outputs[0].token_ids
        differs += name is not None and list(base) != ours
    assert differs  # the adapters changed some outputs: the test can fail
