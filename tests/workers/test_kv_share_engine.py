"""The cluster tier's engine side on the demo model: one engine exports the blocks it
computed, another, which never saw the prompt, takes them with the request and restores them
instead of computing them, with the greedy tokens of a run without them (and transformers').
Blocks that fail a check are refused and recomputed."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from tests.workers.parity import assert_outputs_match_hf
from workers import LLM, SamplingParams
from workers.config import EngineArgs
from workers.core.kv_events import BlocksExported
from workers.messages.kv_blocks import KvBlockData

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = list(range(10, 110))  # 6 full blocks of 16, and 4 tokens
GIB = 1 / 64


def _llm(demo_dir: Path, **kw) -> LLM:  # noqa: ANN003
    args = EngineArgs(model=str(demo_dir), kv_offload_gib=GIB, kv_events=True, kv_share=True, **kw)
    return LLM(**asdict(args))


def _exported(llm: LLM) -> list[KvBlockData]:
    events = llm.engine.block_manager.pop_kv_events()
    return [b for e in events if isinstance(e, BlocksExported) for b in e.blocks]


def _generate_with(llm: LLM, prompt: list[int], blocks: list[KvBlockData]):  # noqa: ANN202
    engine = llm.engine
    inp = engine.input_checker.request(GREEDY).prompt(prompt, engine.tokenizer)
    engine.add_request("pulled", replace(inp, kv_blocks=tuple(blocks)))
    out = llm._run(["pulled"], use_tqdm=False)[0]
    engine.block_manager.check_invariants()
    return out


@pytest.fixture(scope="module")
def exporter(demo_dir):  # noqa: ANN001, ANN201
    """A's run of the prompt and the blocks it exported."""
    a = _llm(demo_dir)
    out = a.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    return out, _exported(a)


def test_exported_blocks_chain_over_the_prompt(exporter) -> None:  # noqa: ANN001
    out, blocks = exporter
    # The prompt's 6 full blocks (its 7th fills with outputs only after 12 tokens).
    assert [b.token_ids for b in blocks] == [tuple(PROMPT[i * 16 : (i + 1) * 16]) for i in range(6)]
    assert blocks[0].parent_hash is None
    assert all(b.parent_hash == a.block_hash for a, b in zip(blocks, blocks[1:], strict=False))
    assert all(len(b.shards) == 1 and b.shards[0].dtype == np.uint8 for b in blocks)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_peer_restores_pulled_blocks_not_recomputes(demo_dir, exporter, async_scheduling) -> None:  # noqa: ANN001
    a_out, blocks = exporter
    b = _llm(demo_dir, async_scheduling=async_scheduling)
    out = _generate_with(b, PROMPT, blocks)
    assert out.outputs[0].token_ids == a_out.outputs[0].token_ids
    assert out.num_cached_tokens == 96
    stats = b.stats()
    assert stats.kv_offload_hit_tokens == 96 and stats.kv_offload_copies_in == 6
    assert sum(b.engine.pop_step_token_counts()) == len(PROMPT) - 96 + GREEDY.max_tokens - 1
    assert b.engine.block_manager.share.imported == 6
    # B exports only what it computed itself: the pulled blocks came from the tier.
    assert not any(x.block_hash in {y.block_hash for y in blocks} for x in _exported(b))
    if not async_scheduling:
        assert_outputs_match_hf(demo_dir, [PROMPT], [out], GREEDY.max_tokens)


def _tampered(blocks: list[KvBlockData], how: str) -> list[KvBlockData]:
    third = blocks[2]
    if how == "tokens":  # its hash no longer chains over what it claims to hold
        bad = replace(third, token_ids=(1,) + third.token_ids[1:])
    else:  # bytes of another layout
        bad = replace(third, shards=(np.zeros(8, np.uint8),))
    return [*blocks[:2], bad, *blocks[3:]]


@pytest.mark.parametrize("how", ["tokens", "shape"])
def test_a_block_that_fails_a_check_is_refused_and_recomputed(demo_dir, exporter, how) -> None:  # noqa: ANN001
    a_out, blocks = exporter
    b = _llm(demo_dir)
    out = _generate_with(b, PROMPT, _tampered(blocks, how))
    assert out.outputs[0].token_ids == a_out.outputs[0].token_ids
    share = b.engine.block_manager.share
    assert share.refused == 1 and share.imported == 5
    # The run stops at the refused block: only the two before it are restored.
    assert out.num_cached_tokens == 32


def test_blocks_under_another_adapter_salt_are_never_restored(demo_dir, exporter) -> None:  # noqa: ANN001
    """A block's hash chains over its salt: blocks computed under an adapter (salt 7 here,
    their hashes made for it) do not match a base-model prompt, which computes everything."""
    from workers.core.block_hash import chain_hash

    a_out, blocks = exporter
    salted, parent = [], None
    for blk in blocks:
        h = chain_hash(parent, blk.token_ids, 7)
        salted.append(replace(blk, block_hash=h, parent_hash=parent, salt=7))
        parent = h
    b = _llm(demo_dir)
    out = _generate_with(b, PROMPT, salted)
    assert out.outputs[0].token_ids == a_out.outputs[0].token_ids
    assert out.num_cached_tokens == 0 and b.stats().kv_offload_hit_tokens == 0
