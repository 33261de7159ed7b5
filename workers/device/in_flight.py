"""A launched step's results on their way to the host, and the tokens the next step takes
straight from the device before they get there.

Async scheduling (EngineArgs.async_scheduling, workers/core/engine.py) launches step N+1 before
step N's sampled tokens reach the host. A sequence that decodes in both steps then has, on the
worker, a placeholder where its step-N token goes (`SeqState.add_placeholder`), and its step
N+1 input is that token: `fill_placeholders` copies it, on the device, from step N's sampled
tokens into the step's input ids. The engine's next diff sends the value, which overwrites the
placeholder (`SeqState.receive`). Synchronous steps resolve before the next is built, so their
placeholders are always overwritten first and nothing is filled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.device.layers.sampler import HostCopy, logprobs_to_dicts
from workers.device.layers.sampling_batch import SamplingBatch
from workers.device.model_runner import ModelInput
from workers.device.scoring import ScoringOutputs
from workers.messages.step import StepOutput


@dataclass(frozen=True)
class SampledTokens:
    """One step's sampled tokens, still on the device, and each sequence's row in them."""

    tokens: torch.Tensor  # [B] long
    rows: dict[str, int]


def fill_placeholders(inp: ModelInput, prev: SampledTokens | None) -> None:
    """Writes the previous step's sampled tokens into `inp.input_ids` (on the device, without
    waiting for it) at the rows whose token is a placeholder. Such a row is always a decode
    that samples: its token is the sequence's last, sampled by the step before."""
    picks: list[tuple[int, int]] = []
    for k, s in enumerate(inp.sample_states):
        if not s.num_placeholders:
            continue
        if (
            s.num_placeholders > 1
            or s.num_scheduled != 1
            or prev is None
            or (s.seq_id not in prev.rows)
        ):
            raise RuntimeError(
                f"{s.seq_id}: a step computes {s.num_placeholders} unknown tokens that the "
                "previous step did not sample (async scheduling looks one step ahead only)"
            )
        picks.append((k, prev.rows[s.seq_id]))
    if not picks:
        return
    device = inp.input_ids.device
    # A pinned source: the upload does not wait for the device (a pageable one would).
    idx = torch.tensor(picks, dtype=torch.long, pin_memory=device.type == "cuda")
    idx = idx.to(device, non_blocking=True)
    inp.input_ids[inp.logits_indices[idx[:, 0]]] = prev.tokens[idx[:, 1]]


class PendingOutput:
    """The driver rank's step output: its sampled tokens (and logprobs) travel to the host in
    one non-blocking copy started at launch; `result()` waits for it."""

    def __init__(
        self,
        seq_ids: list[str],
        copy: HostCopy | None,
        batch: SamplingBatch | None,
        extras: ScoringOutputs,
    ) -> None:
        self.seq_ids = seq_ids
        self.copy = copy  # None: no row sampled
        self.batch = batch  # None: plain greedy rows (no logprobs)
        self.extras = extras  # prompt logprobs and embeddings, already on the host
        self.lora_load_s = 0.0
        self.expert_tokens: tuple[tuple[int, ...], ...] | None = None

    def result(self) -> StepOutput:
        out = StepOutput([], [])
        if self.copy is not None:
            sampled = self.copy.wait()
            logprobs = None
            if sampled.logprobs is not None and self.batch is not None:
                logprobs = logprobs_to_dicts(sampled, self.batch)
            out = StepOutput(self.seq_ids, sampled.token_ids.tolist(), logprobs)
        out = self.extras.attach(out)
        out.lora_load_s = self.lora_load_s
        out.expert_tokens = self.expert_tokens
        return out
