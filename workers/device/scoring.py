"""What a step computes beyond sampling, on the driver rank: prompt logprobs and embeddings.

- Prompt logprobs (`SamplingParams.prompt_logprobs`): the log-softmax of the raw logits at
  each prompt position, scoring the next prompt token, with the top-N there. The rows come
  after the sample rows in the step's logits (`ModelInput.logits_indices`); one top-k and one
  `tolist()` serve every scored row of the step.
- Embeddings (`SamplingParams.pooling`): the final norm of the last layer's hidden states
  (what transformers returns as `last_hidden_state`), pooled over the prompt: its last token,
  or the mean over every token, summed chunk by chunk on the sequence's worker state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.device.model_runner import ChunkRows, ModelInput
from workers.messages.step import StepOutput


@dataclass
class ScoringOutputs:
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    embeddings: dict[str, list[float]] = field(default_factory=dict)

    def attach(self, out: StepOutput) -> StepOutput:
        out.prompt_logprobs = self.prompt_logprobs or None
        out.embeddings = self.embeddings or None
        return out


def scoring_outputs(
    model: torch.nn.Module, x: torch.Tensor, logits: torch.Tensor | None, inp: ModelInput
) -> ScoringOutputs:
    """`x`: the step's hidden states [T, hidden] before the final norm; `logits`: the rows of
    `inp.logits_indices` (sample rows first)."""
    out = ScoringOutputs()
    if inp.prompt_chunks:
        assert logits is not None
        scored = logits[len(inp.sample_states) :]
        out.prompt_logprobs = prompt_logprobs(scored, inp.prompt_chunks)
    for chunk in inp.pool_chunks:
        vec = _pool(model, x, chunk)
        if vec is not None:
            out.embeddings[chunk.state.seq_id] = vec
    return out


def prompt_logprobs(
    logits: torch.Tensor, chunks: list[ChunkRows]
) -> dict[str, tuple[int, list[dict[int, float]]]]:
    """Per chunk: (its first position, one {token_id: logprob} per row), each holding the
    top-N (descending) and then the prompt token that follows the row's position."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    targets = [
        t for c in chunks for t in c.state.token_ids[c.first_pos + 1 : c.first_pos + 1 + c.count]
    ]
    target_t = torch.tensor(targets, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, target_t[:, None])[:, 0].tolist()
    top_n = max(c.state.params.prompt_logprobs or 0 for c in chunks)
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if top_n:
        vals, idx = lp.topk(top_n, dim=-1)
        top_vals, top_ids = vals.tolist(), idx.tolist()
    result: dict[str, tuple[int, list[dict[int, float]]]] = {}
    row = 0
    for c in chunks:
        n = c.state.params.prompt_logprobs or 0
        entries: list[dict[int, float]] = []
        for _ in range(c.count):
            entry = dict(zip(top_ids[row][:n], top_vals[row][:n], strict=True)) if n else {}
            entry.setdefault(targets[row], chosen[row])
            entries.append(entry)
            row += 1
        result[c.state.seq_id] = (c.first_pos, entries)
    return result


def _pool(model: torch.nn.Module, x: torch.Tensor, chunk: ChunkRows) -> list[float] | None:
    """The chunk's share of its sequence's embedding; the embedding once the prompt is done."""
    s = chunk.state
    pooling = s.params.pooling
    assert pooling is not None
    done = chunk.first_pos + chunk.count == s.prompt_len
    if pooling.kind == "last":
        if not done:
            return None
        last = torch.tensor([chunk.first_row + chunk.count - 1], device=x.device)
        vec = model.norm(x[last]).float()[0]
    else:
        rows = torch.arange(chunk.first_row, chunk.first_row + chunk.count, device=x.device)
        part = model.norm(x[rows]).float().sum(dim=0)
        s.pool_sum = part if s.pool_sum is None else s.pool_sum + part
        if not done:
            return None
        vec = s.pool_sum / s.prompt_len
        s.pool_sum = None
    if pooling.normalize:
        vec = torch.nn.functional.normalize(vec, dim=0)
    return vec.tolist()
