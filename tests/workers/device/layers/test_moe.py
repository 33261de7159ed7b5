"""The MoE MLP against a per-token reference and transformers' own blocks (bit for bit)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from workers.device.distributed import SINGLE, TPGroup
from workers.device.layers.moe import ExpertPartition, SparseMoeBlock
from workers.moe_config import MoeConfig

HIDDEN, INTER = 64, 32


def _config(experts: int, k: int, renormalize: bool = True, model_dtype: bool = True) -> MoeConfig:
    return MoeConfig(experts, k, INTER, renormalize, model_dtype, sparse_layers=(0,))


def _block(moe: MoeConfig, dtype=torch.float32, tp: TPGroup = SINGLE, seed: int = 0):  # noqa: ANN001, ANN202
    """A block with random weights; at TP > 1, rank `tp.rank`'s shard of the same weights."""
    gen = torch.Generator().manual_seed(seed)
    full = SparseMoeBlock(HIDDEN, moe, SINGLE, torch.float32)
    for p in full.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    block = SparseMoeBlock(HIDDEN, moe, tp, dtype)
    part = block.partition
    cols = slice(part.inter_start, part.inter_start + part.inter_size)
    held = slice(part.first_expert, part.first_expert + part.num_local_experts)
    block.gate.copy_(full.gate)
    gate, up = full.w13[held].split(INTER, dim=1)
    block.w13.copy_(torch.cat([gate[:, cols], up[:, cols]], dim=1))
    block.w2.copy_(full.w2[held][:, :, cols])
    return block


def _reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, in float64 after routing as transformers does."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        probs = torch.softmax(F.linear(x[t], block.gate).double(), dim=-1)
        top = torch.topk(probs, block.top_k)
        weights = top.values / top.values.sum() if block.renormalize else top.values
        for w, e in zip(weights.tolist(), top.indices.tolist(), strict=True):
            gate, up = (x[t].double() @ block.w13[e].double().T).split(block.inter)
            out[t] += w * ((F.silu(gate) * up) @ block.w2[e].double().T)
    return out


@pytest.mark.parametrize(
    ("experts", "k", "renormalize"),
    [(4, 2, True), (4, 2, False), (8, 1, True), (8, 1, False), (8, 3, True), (6, 6, False)],
)
def test_matches_a_per_token_reference(experts: int, k: int, renormalize: bool) -> None:
    block = _block(_config(experts, k, renormalize))
    for tokens in (1, 2, 7, 64):
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
        with torch.inference_mode():
            ours = block(x)
        assert ours.shape == x.shape and ours.dtype == x.dtype
        torch.testing.assert_close(ours.double(), _reference(block, x), rtol=1e-5, atol=1e-5)


def test_without_renormalisation_the_weights_are_the_raw_probabilities() -> None:
    # top-1 of 8 without renormalising scales the expert's output by p < 1; with it, by 1.
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(1))
    raw = _block(_config(8, 1, renormalize=False))
    with torch.inference_mode():
        weights, _ = raw.route(x)
        assert (weights < 1).all()
        renormed = dataclasses.replace(_config(8, 1), renormalize=True)
        one, _ = _block(renormed).route(x)
    assert torch.equal(one, torch.ones_like(one))


class _CountLinear(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is F.linear:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_experts_run_once_per_step_and_only_when_picked() -> None:
    block = _block(_config(8, 2))
    with torch.inference_mode():
        # Uneven loads: with positive inputs, experts 2..7 score far below 0 and 1, so every
        # token picks 0 and 1; their matmuls run once each over all 50 tokens.
        block.gate[:2] = 0
        block.gate[2:] = -10.0
        x = torch.randn(50, HIDDEN, generator=torch.Generator().manual_seed(2)).abs()
        _, ids = block.route(x)
        assert set(ids.flatten().tolist()) == {0, 1}
        counter = _CountLinear()
        with counter:
            ours = block(x)
        # The router, then gate/up and down of the two experts picked; the six others skipped.
        assert counter.calls == 1 + 2 * 2
        torch.testing.assert_close(ours.double(), _reference(block, x), rtol=1e-5, atol=1e-5)
        # One decode row: k experts run, whatever the expert count.
        counter = _CountLinear()
        with counter:
            block(x[:1])
        assert counter.calls == 1 + 2 * 2


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_for_bit_transformers_block(family: str, dtype: torch.dtype) -> None:
    # Same order of operations and dtypes as transformers' inference code: in bfloat16,
    # Qwen3-MoE scales expert outputs by weights cast to bfloat16, Mixtral in float32.
    hf, moe = _hf_block(family)
    ours = SparseMoeBlock(HIDDEN, moe, SINGLE, dtype)
    hf = hf.to(dtype)
    x = torch.randn(1, 45, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        ours.gate.copy_(hf.gate.weight)
        ours.w13.copy_(hf.experts.gate_up_proj)
        ours.w2.copy_(hf.experts.down_proj)
        expected = hf(x)[0]
        assert torch.equal(ours(x[0]), expected)
        if dtype == torch.bfloat16:  # the other family's order differs: the test can tell
            ours.weights_in_model_dtype = not ours.weights_in_model_dtype
            assert not torch.equal(ours(x[0]), expected)


def _hf_block(family: str):  # noqa: ANN202
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(4)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            hidden_size=HIDDEN,
            moe_intermediate_size=INTER,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        )
        block, moe = Qwen3MoeSparseMoeBlock(cfg), _config(8, 2)
    else:
        cfg = MixtralConfig(
            hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=8, num_experts_per_tok=2
        )
        block, moe = MixtralSparseMoeBlock(cfg), _config(8, 2, model_dtype=False)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.15)
    return block.eval(), moe


def test_tensor_parallel_shards_sum_to_the_whole() -> None:
    # Each rank holds every expert's slice of the intermediate dim; the sum of the ranks'
    # outputs (what the all-reduce computes) is the unsharded output.
    moe = _config(4, 2)
    whole = _block(moe)
    x = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = whole(x)
        parts = []
        for rank in range(2):
            shard = _block(moe, tp=TPGroup(rank, 2))
            assert shard.w13.shape == (4, INTER, HIDDEN) and shard.w2.shape == (4, HIDDEN, 16)
            parts.append(shard.experts(x, *shard.route(x)))
    torch.testing.assert_close(parts[0] + parts[1], expected, rtol=1e-5, atol=1e-6)


def test_expert_parallel_shards_sum_to_the_whole() -> None:
    # Each rank holds half of the experts, whole; a token whose experts are all elsewhere
    # gets zeros from this rank, and the sum over ranks is the unsharded output.
    moe = dataclasses.replace(_config(8, 2), expert_parallel=True)
    whole = _block(dataclasses.replace(moe, expert_parallel=False))
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        expected = whole(x)
        parts = []
        for rank in range(2):
            shard = _block(moe, tp=TPGroup(rank, 2))
            assert shard.partition == ExpertPartition(4 * rank, 4, 0, INTER)
            assert shard.w13.shape == (4, 2 * INTER, HIDDEN)
            parts.append(shard.experts(x, *shard.route(x)))
    assert all(p.abs().sum() > 0 for p in parts)
    torch.testing.assert_close(parts[0] + parts[1], expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"number of experts \(8\) is not divisible"):
        ExpertPartition.of(moe, TPGroup(0, 3))


def test_partition_under_tensor_parallelism() -> None:
    moe = _config(8, 2)
    part = ExpertPartition.of(moe, TPGroup(1, 2))
    assert part == ExpertPartition(0, 8, 16, 16)
    assert [part.local_index(e) for e in (0, 7, 8)] == [0, 7, None]
    with pytest.raises(ValueError, match=r"intermediate size \(32\) is not divisible"):
        ExpertPartition.of(moe, TPGroup(0, 3))


def test_tokens_per_expert_are_counted_as_routed() -> None:
    block = _block(_config(8, 3))
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        block(x[:25])
        block(x[25:])
        _, ids = block.route(x)
    expected = torch.bincount(ids.reshape(-1), minlength=8)
    assert block.expert_tokens.tolist() == expected.tolist() and expected.sum() == 40 * 3
    assert (expected == 0).sum() < 8  # some expert got tokens: the counts can differ from zero


def test_the_engine_reports_tokens_per_expert(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from tests.moe_checkpoints import make_moe_checkpoint
    from workers import LLM, SamplingParams
    from workers.device import worker

    monkeypatch.setattr(worker, "EXPERT_REPORT_S", 0.0)  # every step: the latest is exact
    path = make_moe_checkpoint("qwen3_moe", tmp_path / "moe", num_experts=8, top_k=2)
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.generate([[5, 6, 7], [9, 10, 11, 12, 13]], params, use_tqdm=False)
    loads = llm.stats().moe_expert_tokens
    computed = (3 + 5) + 2 * 5  # the prompts, then five decodes each (the 6th token is not fed)
    assert loads and all(len(row) == 8 and sum(row) == computed * 2 for row in loads)
