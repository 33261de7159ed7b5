"""Vectorised sampling: penalties, min_tokens, temperature, top-k, top-p, min-p, seeds, logprobs.

Three modules: `workers.device.layers.sampling_batch` (one step's metadata as tensors),
`workers.device.layers.logits_processors` (penalties and filters on the logits) and this one (the
draw, seeds, logprobs).

Interface
---------
Once per engine step, for the B sequences that need a token this step::

    batch = SamplingBatch.build(params, prompt_token_ids, output_token_ids,
                                device=logits.device, vocab_size=logits.shape[-1],
                                grammar=(rows, packed_bitmask))  # constrained rows, if any
    out = sampler(logits, batch)        # logits: [B, V] float32 on any device
    out.token_ids                       # [B] long, on logits.device
    out.logprobs, out.logprob_token_ids # [B, N+1] or None (N = batch.max_logprobs):
                                        # column 0 the chosen token, columns 1..N the top-N
                                        # tokens by logprob, descending
    logprobs_to_dicts(out, batch)       # per row {token_id: logprob} (or None), one transfer

`Sampler(seed)` holds the engine-level random generator for unseeded rows; everything else
about a step lives in the `SamplingBatch`, which holds only the tensors some row needs (None
otherwise), so a step pays only for what its rows asked for. When every row is greedy with no
penalties, min_tokens or logprobs, a step is a single argmax.

Order of operations (vLLM's):

0. Constrained rows (a grammar): tokens the grammar does not allow become -inf, before
   anything else that reads the logits to choose (logprobs stay the model's own, below).
1. logprobs are the model's own distribution, ``log_softmax(logits)`` of the raw logits before
   any penalty, min_tokens block or temperature. This is vLLM v1's default ("raw_logprobs")
   and what transformers reports for the same checkpoint, so the two can be compared.
2. Penalties, on the raw logits: repetition (tokens seen in prompt or output: positive logits
   divided by the penalty, others multiplied), then frequency (minus penalty x count in the
   output), then presence (minus penalty once if the token occurs in the output).
3. min_tokens: while a row has fewer output tokens than min_tokens, its EOS and stop token ids
   get -inf.
4. Greedy rows (temperature < 1e-5 or top_k == 1) take the argmax; ties go to the lowest id.
5. Other rows: divide by temperature, keep the top-k, keep the smallest prefix of the sorted
   distribution whose mass reaches top_p (the top token always survives; tokens tied with the
   last survivor of top-k or top-p survive too), drop tokens whose probability is below
   min_p x the highest, then sample by the exponential race
   ``argmax(probs / q)`` with q ~ Exp(1) per vocabulary entry.

Seeding: a row with ``SamplingParams.seed`` draws its noise from a generator re-seeded from a
hash of (seed, position), position being the number of tokens the row has generated already.
Its tokens therefore depend only on its own logits, seed and position: the same alone or in
any batch, and after preemption and recomputation. Unseeded rows share the Sampler's
generator in one batched draw.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from workers.device.layers.logits_processors import (
    apply_filters,
    apply_penalties,
    apply_token_bitmask,
)
from workers.device.layers.sampling_batch import SamplingBatch

_MASK64 = (1 << 64) - 1


def greedy_tokens(logits: Tensor) -> Tensor:
    """Each row's argmax (the first maximum on ties; a NaN wins, as with argmax), through
    max's indices: half argmax's time on CPU (160 against 370 us for 128 rows of the demo's
    vocabulary)."""
    return logits.max(dim=-1).indices


class SamplerOutput(NamedTuple):
    token_ids: Tensor  # [B] long
    logprobs: Tensor | None  # [B, N+1] float32: chosen token first, then top-N descending
    logprob_token_ids: Tensor | None  # [B, N+1] long, ids matching `logprobs`

    def to_host(self) -> SamplerOutput:
        """The same on the host, in one device-to-host copy (one wait for the device): the
        logprobs' float32 bits ride in int64 beside the ids, and come back bit for bit."""
        return self.start_to_host().wait()

    def packed_to_host(self) -> SamplerOutput:
        """Through the packed copy, whatever the device (the CPU path skips it)."""
        return _unpack(self._packed().cpu(), self.logprobs is not None)

    def start_to_host(self) -> HostCopy:
        """Starts the copy without waiting for the device: on CUDA a non-blocking copy into
        pinned memory, then an event the host waits on in `HostCopy.wait` (async scheduling
        launches the next step in between)."""
        if self.token_ids.device.type == "cpu":
            return HostCopy(self, None, None)
        packed = self._packed()
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return HostCopy(None, event, host, self.logprobs is not None)

    def _packed(self) -> Tensor:
        """[B] token ids, or [B, 1 + 2(N+1)]: ids, logprob ids, the logprobs' float32 bits."""
        if self.logprobs is None or self.logprob_token_ids is None:
            return self.token_ids
        bits = self.logprobs.contiguous().view(torch.int32).to(torch.int64)
        return torch.cat([self.token_ids[:, None], self.logprob_token_ids, bits], dim=1)


class HostCopy(NamedTuple):
    """A SamplerOutput on its way to the host: on CUDA a pinned buffer that holds the packed
    copy once `event` has completed; on CPU the output itself."""

    output: SamplerOutput | None
    event: torch.cuda.Event | None = None
    buffer: Tensor | None = None
    has_logprobs: bool = False

    def wait(self) -> SamplerOutput:
        if self.output is not None:
            return self.output
        assert self.event is not None and self.buffer is not None
        self.event.synchronize()
        return _unpack(self.buffer, self.has_logprobs)


def _unpack(packed: Tensor, has_logprobs: bool) -> SamplerOutput:
    if not has_logprobs:
        return SamplerOutput(packed, None, None)
    n = (packed.shape[1] - 1) // 2
    values = packed[:, 1 + n :].to(torch.int32).view(torch.float32)
    return SamplerOutput(packed[:, 0], values, packed[:, 1 : 1 + n])


class Sampler:
    """Turns one step's logits into tokens. Holds only the generator for unseeded rows."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        # One generator per device, made on first use so the sampler follows the logits.
        self._generators: dict[torch.device, torch.Generator] = {}
        self._seeded: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dtype != torch.float32:
            logits = logits.float()
        raw_logprobs = logits.log_softmax(-1) if batch.max_logprobs >= 0 else None
        logits = apply_token_bitmask(logits, batch)
        logits = apply_penalties(logits, batch)
        if batch.blocked is not None:
            logits = logits.index_put(batch.blocked, _neg_inf(logits))
        if batch.all_greedy:
            tokens = greedy_tokens(logits)
        else:
            tokens = self._sample(logits, batch)
        if raw_logprobs is None:
            return SamplerOutput(tokens, None, None)
        chosen_ids = tokens.unsqueeze(1)
        values, ids = raw_logprobs.gather(1, chosen_ids), chosen_ids
        if batch.max_logprobs > 0:
            top_values, top_ids = raw_logprobs.topk(batch.max_logprobs, dim=-1)
            values = torch.cat([values, top_values], dim=1)
            ids = torch.cat([ids, top_ids], dim=1)
        return SamplerOutput(tokens, values, ids)

    def _sample(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        probs = apply_filters(logits, batch).softmax(-1)
        tokens = probs.div_(self._exponential_noise(probs, batch)).argmax(-1)
        if batch.greedy is not None:
            tokens = torch.where(batch.greedy, greedy_tokens(logits), tokens)
        return tokens

    def _exponential_noise(self, probs: Tensor, batch: SamplingBatch) -> Tensor:
        """Exp(1) draws as -log(U): on CPU several times faster than exponential_().

        U lies in [0, 1), so q lies in (0, inf]: no division by zero, and a zero probability
        gives 0 / q = 0, never the NaN that argmax would pick.
        """
        # Rows drawn by neither branch (greedy ones) keep garbage: their argmax replaces them.
        u = torch.empty_like(probs)
        device = probs.device
        if batch.shared_noise:
            u.uniform_(generator=self._generator(device))
        if batch.seeded_rows:
            gen = self._seeded.get(device)
            if gen is None:
                gen = self._seeded[device] = torch.Generator(device=device)
            for row in batch.seeded_rows:
                seed = batch.seeds[row]
                assert seed is not None
                gen.manual_seed(_mix_seed(seed, batch.positions[row]))
                u[row].uniform_(generator=gen)
        return u.log_().neg_()

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            gen.manual_seed(self._seed)
        return gen


def logprobs_to_dicts(output: SamplerOutput, batch: SamplingBatch) -> list[dict[int, float] | None]:
    """Per row: {token_id: logprob} with the top-N (descending) and then the chosen token."""
    if output.logprobs is None or output.logprob_token_ids is None:
        return [None] * batch.num_rows
    values = output.logprobs.tolist()
    ids = output.logprob_token_ids.tolist()
    result: list[dict[int, float] | None] = []
    for n, row_values, row_ids in zip(batch.num_logprobs, values, ids, strict=True):
        if n is None:
            result.append(None)
            continue
        entry = dict(zip(row_ids[1 : n + 1], row_values[1 : n + 1], strict=True))
        entry.setdefault(row_ids[0], row_values[0])
        result.append(entry)
    return result


def _neg_inf(like: Tensor) -> Tensor:
    # A fill on the device: torch.tensor(value, device=...) would copy from the host and wait.
    return torch.full((), float("-inf"), dtype=like.dtype, device=like.device)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix_seed(seed: int, position: int) -> int:
    """A generator seed for (request seed, position): unrelated for neighbouring inputs."""
    z = _splitmix64(_splitmix64(seed & _MASK64) + position)
    # The CPU generator keeps only the low 32 bits of a seed; fold the high half into them.
    return z ^ (z >> 32)
