"""Vectorised sampling: penalties, min_tokens, temperature, top-k, top-p, min-p, seeds, logprobs.

Interface
---------
Once per engine step, for the B sequences that need a token this step::

    batch = SamplingBatch.build(params, prompt_token_ids, output_token_ids,
                                device=logits.device, vocab_size=logits.shape[-1])
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

from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import torch
from torch import Tensor

from workers.sampling_params import SamplingParams

# Stored for rows that switch top-p off: a prefix's preceding mass never reaches 2, so the row
# is untouched even when float rounding pushes a cumulative sum a hair above 1.
_TOP_P_OFF = 2.0
_MASK64 = (1 << 64) - 1
# Tokens a top-p row without top-k looks at before falling back to sorting the vocabulary.
_TOP_P_PROBE = 1024


class SamplerOutput(NamedTuple):
    token_ids: Tensor  # [B] long
    logprobs: Tensor | None  # [B, N+1] float32: chosen token first, then top-N descending
    logprob_token_ids: Tensor | None  # [B, N+1] long, ids matching `logprobs`


@dataclass(frozen=True)
class SamplingBatch:
    """One step's sampling metadata, on the logits' device. Build it with `SamplingBatch.build`.

    Optional tensors are None when no row needs them. Per-row tensors for penalties cover only
    the rows listed in `penalty_rows` (all rows when it is None).
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    greedy: Tensor | None  # [B] bool; only in a batch mixing greedy and random rows
    temperature: Tensor | None  # [B] float; None when all rows are greedy (greedy rows hold 1)
    top_k: Tensor | None  # [B] long in [1, V]; rows without top-k hold V
    top_p: Tensor | None  # [B] float; rows without top-p hold _TOP_P_OFF
    candidates: int  # how many best tokens per row top-k/top-p look at first (V: a full sort)
    top_p_probe: bool  # a top-p row lacks top-k: sort all V if the candidates fall short
    min_p: Tensor | None  # [B] float; rows without min-p hold 0
    penalty_rows: Tensor | None  # [P] long: the rows with any penalty, None when all rows
    repetition_penalty: Tensor | None  # [P, 1]
    frequency_penalty: Tensor | None  # [P, 1]
    presence_penalty: Tensor | None  # [P, 1]
    output_counts: Tensor | None  # [P, V] float: occurrences of each token in the output
    prompt_mask: Tensor | None  # [P, V] bool: token occurs in the prompt (repetition only)
    blocked: tuple[Tensor, Tensor] | None  # (rows, token ids) to set to -inf (min_tokens)
    seeds: list[int | None]
    positions: list[int]  # tokens generated so far, per row
    seeded_rows: list[int]  # non-greedy rows with a seed: they draw their own noise
    shared_noise: bool  # some non-greedy row has no seed: draw from the Sampler's generator
    num_logprobs: list[int | None]  # per row, as requested
    max_logprobs: int  # the largest top-N requested, -1 when no row wants logprobs

    @property
    def any_penalty(self) -> bool:
        return self.output_counts is not None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        *,
        device: torch.device | str,
        vocab_size: int,
        blocked_token_ids: list[list[int]] | None = None,
    ) -> SamplingBatch:
        """Collect per-row options into batched tensors.

        `prompt_token_ids` is read only for rows with a repetition penalty and
        `output_token_ids` only for rows with a penalty (plus its length, for positions and
        min_tokens); ids must be < vocab_size. `blocked_token_ids` overrides which ids each row
        has blocked this step; by default a row shorter than min_tokens blocks its stop ids and
        (unless ignore_eos) its EOS ids.
        """
        num_rows = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == num_rows):
            raise ValueError("params, prompt_token_ids and output_token_ids differ in length")
        device = torch.device(device)
        positions = [len(out) for out in output_token_ids]
        greedy = [p.greedy for p in params]
        seeds = [p.seed for p in params]
        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]

        # Per-row scalars travel to the device in one transfer (see _rows_to_device).
        columns, candidates, top_p_probe = _filter_columns(params, greedy, vocab_size)
        columns.update(_penalty_columns([params[i] for i in pen_rows]))
        t = _rows_to_device(columns, device)
        output_counts, prompt_mask = _token_tables(
            [params[i] for i in pen_rows],
            [prompt_token_ids[i] for i in pen_rows],
            [output_token_ids[i] for i in pen_rows],
            vocab_size,
            device,
        )

        if blocked_token_ids is None:
            blocked_token_ids = [
                _min_tokens_block(p) if p.min_tokens > n else []
                for p, n in zip(params, positions, strict=True)
            ]
        # Out-of-vocabulary stop ids can never be sampled; dropping them keeps index_put valid.
        blocked_lists = [[i for i in ids if 0 <= i < vocab_size] for ids in blocked_token_ids]

        num_logprobs = [p.logprobs for p in params]
        requested = [n for n in num_logprobs if n is not None]
        top_k, greedy_mask = t.get("top_k"), t.get("greedy")
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            greedy=greedy_mask.bool() if greedy_mask is not None else None,
            temperature=t.get("temperature"),
            top_k=top_k.long() if top_k is not None else None,
            top_p=t.get("top_p"),
            candidates=candidates,
            top_p_probe=top_p_probe,
            min_p=t.get("min_p"),
            penalty_rows=(
                torch.tensor(pen_rows, dtype=torch.long, device=device)
                if pen_rows and len(pen_rows) < num_rows
                else None
            ),
            repetition_penalty=_column(t, "repetition_penalty"),
            frequency_penalty=_column(t, "frequency_penalty"),
            presence_penalty=_column(t, "presence_penalty"),
            output_counts=output_counts,
            prompt_mask=prompt_mask,
            blocked=_row_col(blocked_lists, device) if any(blocked_lists) else None,
            seeds=seeds,
            positions=positions,
            seeded_rows=[
                i
                for i, (s, g) in enumerate(zip(seeds, greedy, strict=True))
                if s is not None and not g
            ],
            shared_noise=any(s is None and not g for s, g in zip(seeds, greedy, strict=True)),
            num_logprobs=num_logprobs,
            max_logprobs=min(max(requested), vocab_size) if requested else -1,
        )


def _filter_columns(
    params: list[SamplingParams], greedy: list[bool], vocab_size: int
) -> tuple[dict[str, list[float]], int, bool]:
    """Temperature / top-k / top-p / min-p columns some random row needs; see _mask_top_k_top_p
    for the other two results."""
    if all(greedy):
        return {}, 0, False
    rows = list(zip(params, greedy, strict=True))
    columns = {"temperature": [1.0 if g else p.temperature for p, g in rows]}
    if any(greedy):
        columns["greedy"] = [float(g) for g in greedy]
    # Greedy rows hold "off" so they never widen the candidate list below.
    ks = [vocab_size if g or p.top_k == -1 else min(p.top_k, vocab_size) for p, g in rows]
    top_ps = [_TOP_P_OFF if g or p.top_p >= 1.0 else p.top_p for p, g in rows]
    if any(k < vocab_size for k in ks):
        columns["top_k"] = [float(k) for k in ks]  # exact: float32 holds integers up to 2**24
    if any(top_p < 1.0 for top_p in top_ps):
        columns["top_p"] = top_ps
    if any(p.min_p > 0.0 and not g for p, g in rows):
        columns["min_p"] = [p.min_p for p in params]
    # A row with top-k finds its survivors among its k best tokens. A top-p row without top-k
    # almost always reaches its mass within the best _TOP_P_PROBE tokens, so try those first.
    top_k_max = max((k for k in ks if k < vocab_size), default=0)
    unbounded = any(k >= vocab_size and top_p < 1.0 for k, top_p in zip(ks, top_ps, strict=True))
    candidates = min(max(top_k_max, _TOP_P_PROBE if unbounded else 0), vocab_size)
    return columns, candidates, unbounded and candidates < vocab_size


def _penalty_columns(pen_params: list[SamplingParams]) -> dict[str, list[float]]:
    columns = {}
    if any(p.repetition_penalty != 1.0 for p in pen_params):
        columns["repetition_penalty"] = [p.repetition_penalty for p in pen_params]
    if any(p.frequency_penalty != 0.0 for p in pen_params):
        columns["frequency_penalty"] = [p.frequency_penalty for p in pen_params]
    if any(p.presence_penalty != 0.0 for p in pen_params):
        columns["presence_penalty"] = [p.presence_penalty for p in pen_params]
    return columns


def _token_tables(
    pen_params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
    vocab_size: int,
    device: torch.device,
) -> tuple[Tensor | None, Tensor | None]:
    """[P, V] output token counts, and the prompt-token mask when a row has repetition penalty."""
    if not pen_params:
        return None, None
    shape = (len(pen_params), vocab_size)
    counts = torch.zeros(shape, dtype=torch.float32, device=device)
    counts.index_put_(_row_col(outputs, device), _ones(outputs, device), accumulate=True)
    if all(p.repetition_penalty == 1.0 for p in pen_params):
        return counts, None
    prompts = [
        prompt if p.repetition_penalty != 1.0 else []
        for p, prompt in zip(pen_params, prompts, strict=True)
    ]
    prompt_mask = torch.zeros(shape, dtype=torch.bool, device=device)
    prompt_mask[_row_col(prompts, device)] = True
    return counts, prompt_mask


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
        logits = apply_penalties(logits, batch)
        if batch.blocked is not None:
            logits = logits.index_put(batch.blocked, _neg_inf(logits))
        if batch.all_greedy:
            tokens = logits.argmax(-1)
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
            tokens = torch.where(batch.greedy, logits.argmax(-1), tokens)
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


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition, frequency and presence penalties; returns `logits` itself when none apply."""
    counts = batch.output_counts
    if counts is None:
        return logits
    rows = batch.penalty_rows
    sub = logits if rows is None else logits.index_select(0, rows)
    if batch.repetition_penalty is not None:
        seen = counts > 0
        if batch.prompt_mask is not None:
            seen |= batch.prompt_mask
        penalty = batch.repetition_penalty
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    if batch.frequency_penalty is not None:
        sub = sub - batch.frequency_penalty * counts
    if batch.presence_penalty is not None:
        sub = sub - batch.presence_penalty * (counts > 0)
    if rows is None:
        return sub
    return logits.index_copy(0, rows, sub)


def apply_filters(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Temperature, then top-k, top-p and min-p as -inf; a new tensor (greedy rows: unfiltered)."""
    assert batch.temperature is not None, "all-greedy batches have nothing to filter"
    scaled = logits / batch.temperature.unsqueeze(1)  # a fresh tensor: safe to edit in place
    if batch.top_k is not None or batch.top_p is not None:
        _mask_top_k_top_p(scaled, batch)
    if batch.min_p is not None:
        # p < min_p * p_max  <=>  z < z_max + log(min_p); min_p = 0 gives -inf: nothing dropped.
        floor = scaled.amax(-1, keepdim=True) + batch.min_p.log().unsqueeze(1)
        scaled.masked_fill_(scaled < floor, float("-inf"))
    return scaled


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


def _mask_top_k_top_p(logits: Tensor, batch: SamplingBatch) -> None:
    """Set tokens outside each row's top-k and top-p sets to -inf, in place.

    Both filters work on one list of each row's best `batch.candidates` tokens, descending (a
    topk, far cheaper than sorting the vocabulary). A top-p row without top-k whose mass is not
    reached inside that list makes the list the whole vocabulary, sorted. Both filters cut by
    value, so tokens tied with the last survivor survive too: the result never depends on how
    ties are ordered, hence never on the list's length or on which rows share the batch.
    """
    top_k, top_p, vocab_size = batch.top_k, batch.top_p, logits.shape[-1]
    values, ids = _best(logits, batch.candidates)
    neg_inf = float("-inf")
    if top_k is not None:
        kth = values.gather(1, (top_k.clamp(max=values.shape[1]) - 1).unsqueeze(1))
        kth.masked_fill_((top_k >= vocab_size).unsqueeze(1), neg_inf)
        logits.masked_fill_(logits < kth, neg_inf)
        values = values.masked_fill(values < kth, neg_inf)
    if top_p is None:
        return
    # Normalised over the whole row (the top-k survivors), not just over the list.
    probs = logits.softmax(-1)
    kept = _top_p_kept(probs, ids, top_p)
    # Only rows with top-p on can run off the end (on a host sync, paid only when probing).
    if batch.top_p_probe and bool(((kept == values.shape[1]) & (top_p <= 1.0)).any()):
        values, ids = _best(logits, vocab_size)
        kept = _top_p_kept(probs, ids, top_p)
    cutoff = values.gather(1, kept.unsqueeze(1) - 1)
    cutoff.masked_fill_((top_p > 1.0).unsqueeze(1), neg_inf)
    logits.masked_fill_(logits < cutoff, neg_inf)


def _best(logits: Tensor, count: int) -> tuple[Tensor, Tensor]:
    if count < logits.shape[-1]:
        return logits.topk(count, dim=-1)
    return logits.sort(dim=-1, descending=True)


def _top_p_kept(probs: Tensor, ids: Tensor, top_p: Tensor) -> Tensor:
    """[B] length of each row's top-p prefix of `ids` (the list's length if it falls short)."""
    listed = probs.gather(1, ids)
    # Exclusive prefix sums of non-negative terms never decrease, so the kept entries form a
    # prefix; the first is exactly 0 < top_p, so the top token always stays.
    mass_before = torch.nn.functional.pad(listed.cumsum(-1)[:, :-1], (1, 0))
    return (mass_before < top_p.unsqueeze(1)).sum(-1)


def _min_tokens_block(params: SamplingParams) -> list[int]:
    assert params.stop_token_ids is not None  # normalised to a list by SamplingParams
    eos = [] if params.ignore_eos else list(params.eos_token_ids)
    return eos + params.stop_token_ids


def _row_col(lists: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Flatten ragged per-row id lists into (row index, id) tensors for index_put."""
    lengths = torch.tensor([len(x) for x in lists], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(lists)), lengths).to(device)
    cols = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.long, device=device)
    return rows, cols


def _ones(lists: list[list[int]], device: torch.device) -> Tensor:
    return torch.ones(sum(len(x) for x in lists), dtype=torch.float32, device=device)


def _neg_inf(like: Tensor) -> Tensor:
    return torch.tensor(float("-inf"), dtype=like.dtype, device=like.device)


def _rows_to_device(columns: dict[str, list[float]], device: torch.device) -> dict[str, Tensor]:
    """Ship same-length float columns in one host-to-device copy, then split them by name."""
    out: dict[str, Tensor] = {}
    by_length: dict[int, list[str]] = {}
    for name, values in columns.items():
        by_length.setdefault(len(values), []).append(name)
    for names in by_length.values():
        stacked = torch.tensor([columns[n] for n in names], dtype=torch.float32, device=device)
        out.update(zip(names, stacked.unbind(0), strict=True))
    return out


def _column(tensors: dict[str, Tensor], name: str) -> Tensor | None:
    value = tensors.get(name)
    return value.unsqueeze(1) if value is not None else None


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
