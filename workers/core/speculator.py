"""The engine's side of speculative decoding (workers/spec_decode/): drafts proposed before
the schedule, verified when the step's tokens come back.

A decoding sequence with a draft d_1..d_k is scheduled as a chunk of k+1 tokens (its last
token, then the draft), which the workers compute like a prefill chunk, sampling at each of
the k+1 positions with that position's own noise (the sampler seeds by position). The sample
at position i is the token the target would emit there given the tokens before it; so the
engine keeps the samples while the draft agrees with them (d_i == t_{i-1}) and stops after the
first that disagrees (or after the bonus token t_k):

- the output is the target's own: greedy streams are byte-identical with speculation on and
  off, seeded ones too (the noise depends on the position, not on the step), and unseeded
  ones have the target's distribution. For a deterministic draft (n-gram lookup, an argmax
  draft model) this is exactly the rejection rule: a draft token is accepted with probability
  p(d) = min(1, p(d)/q(d)) where q(d) = 1, and a rejected position yields a sample from p.
- the KV of accepted positions is the target's, computed in the verifying forward; the slots
  of rejected positions are written over when their real tokens are computed (nothing reads a
  position past the sequence's computed tokens). The block manager only registers blocks full
  of known, computed tokens, so the prefix cache never holds a rejected token; blocks allocated
  for a rejected tail stay with the sequence and come back with it.

Which sequences speculate: running decodes whose last token is on the host (not in flight),
without a grammar, thinking budget, penalties or pooling (their per-position masks and counts
would depend on the draft: they decode one token at a time, in the same batches).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers.config import EngineConfig
from workers.core.request import Seq, SeqStatus
from workers.spec_decode.adaptive import SeqAcceptance, StepCost, draft_length
from workers.spec_decode.config import SpeculativeConfig
from workers.spec_decode.ngram import NgramIndex

log = logging.getLogger(__name__)


@dataclass
class SeqSpeculation:
    acceptance: SeqAcceptance = field(default_factory=SeqAcceptance)
    state: Any = None  # the proposer's own (an n-gram index)


class Proposer(Protocol):
    def propose_batch(self, asks: list[tuple[Seq, SeqSpeculation, int]]) -> list[list[int]]:
        """For each (sequence, its speculation state, k): up to k tokens likely to follow the
        sequence's tokens ([] for none)."""
        ...


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose_batch(self, asks: list[tuple[Seq, SeqSpeculation, int]]) -> list[list[int]]:
        drafts = []
        for seq, spec, k in asks:
            if spec.state is None:
                spec.state = NgramIndex(self.min_n, self.max_n)
            drafts.append(spec.state.propose(seq.token_ids, k))
        return drafts


class Speculator:
    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer or NgramProposer(config)
        log.info("speculative decoding: %s", config.describe())
        self.cost = StepCost()
        # vLLM's meanings: drafts = (sequence, step) pairs that carried a draft.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # accepted_per_position[i]: drafts whose token i+1 was accepted.
        self.accepted_per_position = [0] * config.num_speculative_tokens

    def propose(self, running: list[Seq]) -> None:
        """Sets `Seq.draft` of every running sequence (empty where it does not speculate)."""
        c = self.config
        step_tokens = max(len(running), 1)  # a plain step: about a token per sequence
        threshold = self.cost.threshold(step_tokens, step_tokens) if c.adaptive else 0.0
        asks: list[tuple[Seq, SeqSpeculation, int]] = []
        for seq in running:
            seq.draft = []
            if not _speculates(seq):
                continue
            spec = seq.spec
            if spec is None:
                spec = seq.spec = SeqSpeculation()
            limit = min(c.num_speculative_tokens, self._room(seq))
            k = draft_length(spec.acceptance, limit, threshold) if c.adaptive else limit
            if k > 0:
                asks.append((seq, spec, k))
            else:
                spec.acceptance.steps_without += 1
        drafts = self.proposer.propose_batch(asks) if asks else []
        for (seq, spec, k), draft in zip(asks, drafts, strict=True):
            seq.draft = draft[:k]
            if seq.draft:
                spec.acceptance.steps_without = 0
            else:
                spec.acceptance.steps_without += 1

    def _room(self, seq: Seq) -> int:
        """Draft tokens that cannot outrun max_tokens or max_model_len: the step emits up to
        k + 1 tokens, the last of which is not computed in it."""
        room = self.max_model_len - seq.num_tokens - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(room, 0)

    def verify(self, seq: Seq, draft: list[int], sampled: list[int]) -> list[int]:
        """The tokens seq emits from a verifying step (module doc): the samples up to and
        including the first that the draft does not match."""
        a = 0
        while a < len(draft) and sampled[a] == draft[a]:
            a += 1
        self.num_drafts += 1
        self.num_draft_tokens += len(draft)
        self.num_accepted_tokens += a
        for i in range(a):
            self.accepted_per_position[i] += 1
        if seq.spec is not None:
            seq.spec.acceptance.record(len(draft), a)
        return sampled[: a + 1]

    @staticmethod
    def for_engine(config: EngineConfig, make_engine: Callable[..., Any]) -> Speculator | None:
        """The engine's speculator (None: speculation off), its proposer built here (a draft
        model's engine by `make_engine`, the engine class)."""
        spec = config.speculative
        if spec is None:
            return None
        proposer: Proposer | None = None
        if spec.method == "draft_model":
            from workers.spec_decode.draft_model import DraftModelProposer

            proposer = DraftModelProposer(spec, config, make_engine)
        return Speculator(spec, config.scheduler.max_model_len, proposer)

    def shutdown(self) -> None:
        stop = getattr(self.proposer, "shutdown", None)
        if stop is not None:
            stop()

    def record_step(self, tokens: int, seconds: float) -> None:
        """A step of decodes and verifying chunks only: a prompt's tokens cost less each (one
        large product per weight) and would teach the model the wrong price of a draft."""
        self.cost.record(tokens, seconds)

    def stats(self) -> dict[str, object]:
        """EngineStats' speculative-decoding fields."""
        return {
            "spec_decode_drafts": self.num_drafts,
            "spec_decode_draft_tokens": self.num_draft_tokens,
            "spec_decode_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_accepted_per_position": tuple(self.accepted_per_position),
        }


def can_speculate(seq: Seq) -> bool:
    """Whether seq's kind speculates (module doc); under async scheduling its steps then wait
    for their tokens on the host, since a draft continues the known tokens."""
    p = seq.params
    return (
        seq.grammar is None
        and seq.grammar_after is None
        and seq.thinking is None
        and not p.has_penalties
        and p.pooling is None
    )


def _speculates(seq: Seq) -> bool:
    return (
        seq.status is SeqStatus.RUNNING
        and seq.on_workers
        and not seq.num_pending
        and seq.num_computed_tokens == seq.num_tokens - 1
        and can_speculate(seq)
    )
