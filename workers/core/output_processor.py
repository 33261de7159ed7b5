"""Per-sequence output state: text (via OutputText), stop conditions, logprobs, deltas.

`delta_output` is what a streaming (DELTA) request gets while it runs: only what changed
since its previous output, nothing cumulative. `final_output` is the finished sample:
cumulative text, tokens and logprobs, plus the last delta.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from workers.core.request import Request, Seq
from workers.detokenizer import OutputText
from workers.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs


@dataclass(eq=False)
class SeqOutputState:
    text: OutputText
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    logprobs: list[TokenLogprobs] | None = None
    sent_tokens: int = 0  # output tokens handed out in deltas so far
    sent_logprobs: int = 0
    # SamplingParams.prompt_logprobs (the first sample only): one per prompt token, the
    # first None; filled chunk by chunk as the prompt is computed.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    sent_prompt_logprobs: bool = False
    embedding: list[float] | None = None  # SamplingParams.pooling, once computed


def new_output_state(seq: Seq, tokenizer) -> SeqOutputState:  # noqa: ANN001
    p = seq.params
    eos = () if p.ignore_eos else p.eos_token_ids
    return SeqOutputState(
        text=OutputText(
            tokenizer,
            seq.prompt_token_ids,
            p.skip_special_tokens,
            p.stop or (),
            p.include_stop_str_in_output,
        ),
        stop_ids=frozenset(p.stop_token_ids or ()) | frozenset(eos),
        logprobs=[] if p.logprobs is not None else None,
        prompt_logprobs=[None] * seq.prompt_len if p.prompt_logprobs is not None else None,
    )


def record_prompt_logprobs(seq: Seq, first_pos: int, entries: list[TokenLogprobs]) -> None:
    """A chunk's prompt logprobs: entry j scores the prompt token at first_pos + 1 + j. A
    chunk computed again (after a preemption) writes the same values over the old ones."""
    lps = seq.out.prompt_logprobs
    if lps is not None:
        lps[first_pos + 1 : first_pos + 1 + len(entries)] = entries


def finish_pooled(seq: Seq, embedding: list[float]) -> None:
    """An embedding request's prompt is done: it ends here with its embedding ("stop")."""
    seq.out.embedding = embedding
    seq.finish_reason = "stop"
    seq.out.text.flush()


def take_prompt_logprobs(seq: Seq, final: bool) -> list[TokenLogprobs | None] | None:
    """The prompt logprobs for an output: on the finished one always, on a running one once
    (the first output after the prompt is done)."""
    st: SeqOutputState = seq.out
    if st.prompt_logprobs is None:
        return None
    if final:
        return st.prompt_logprobs
    if st.sent_prompt_logprobs or not seq.prefill_done:
        return None
    st.sent_prompt_logprobs = True
    return st.prompt_logprobs


def process_token(seq: Seq, token: int, logprobs: TokenLogprobs | None, max_model_len: int) -> None:
    """Appends one sampled token (already in seq.token_ids) and decides whether seq stops."""
    st: SeqOutputState = seq.out
    p = seq.params
    n_out = seq.num_output_tokens
    if st.logprobs is not None and logprobs is not None:
        st.logprobs.append(logprobs)
    past_min = n_out >= p.min_tokens
    if past_min and token in st.stop_ids:
        # The stop token stays in token_ids but its text is not shown (vLLM does the same).
        seq.finish_reason = "stop"
        seq.stop_reason = token if token in (p.stop_token_ids or ()) else None
        st.text.flush()
        return
    stop = st.text.step([token], check_stop=past_min)
    if stop is not None:
        seq.finish_reason, seq.stop_reason = "stop", stop
    elif (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= max_model_len:
        seq.finish_reason = "length"
        st.text.flush()


def resume_output_state(
    seq: Seq,
    output_token_ids: Sequence[int],
    text_sent: int,
    logprobs: Sequence[TokenLogprobs] | None,
    max_model_len: int,
) -> None:
    """Replays a resumed sample's earlier outputs into seq (fresh, its output state new) the
    way `process_token` saw them, so detokenizer, stop-string holdback, min_tokens and max_tokens
    progress are exactly as if it had never moved. What the client already has is marked
    sent: tokens and logprobs all, text up to `text_sent` (the rest was held back).

    Raises ValueError when the outputs already end the sample (a stop, or a limit this engine
    has lower): such a sample finished and is not resumed."""
    st: SeqOutputState = seq.out
    lps = list(logprobs) if logprobs is not None else None
    for k, token in enumerate(output_token_ids):
        seq.token_ids.append(token)
        process_token(seq, token, lps[k] if lps is not None else None, max_model_len)
        if seq.finish_reason is not None:
            raise ValueError(
                f"resume sample {seq.index} already finished ({seq.finish_reason}) after "
                f"{k + 1} of its {len(output_token_ids)} outputs"
            )
    if len(st.text.text) < text_sent:
        raise ValueError(
            f"resume sample {seq.index} text_sent ({text_sent}) exceeds its text "
            f"({len(st.text.text)} characters)"
        )
    st.sent_tokens = len(output_token_ids)
    st.sent_logprobs = len(st.logprobs) if st.logprobs is not None else 0
    st.text.mark_sent(text_sent)


def finish_out_of_cache(seq: Seq) -> None:
    """The scheduler found seq larger than the whole KV cache: it ends as if at its length
    limit, keeping what it generated."""
    if seq.finish_reason is None:
        seq.finish_reason = "length"
        seq.out.text.flush()


def finish_grammar_complete(seq: Seq) -> None:
    """seq's grammar is complete and allows no more tokens: it stops here ("stop"), also when
    this last token happened to reach max_tokens (the output is whole, not truncated)."""
    if seq.finish_reason is None:
        seq.finish_reason = "stop"
        seq.out.text.flush()
    elif seq.finish_reason == "length":
        seq.finish_reason = "stop"


def finish_abort(seq: Seq, stop_reason: str | None = None) -> None:
    if seq.finish_reason is None:
        seq.finish_reason = "abort"
        seq.stop_reason = stop_reason
        seq.out.text.flush()


def delta_output(seq: Seq) -> CompletionOutput:
    """What changed since the sequence's previous output (finish_reason once it finished)."""
    co = CompletionOutput(
        index=seq.index, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason
    )
    _take_delta(seq, co)
    return co


def final_output(seq: Seq) -> CompletionOutput:
    """The finished sequence: cumulative text, tokens and logprobs, plus the last delta."""
    st: SeqOutputState = seq.out
    co = CompletionOutput(
        index=seq.index,
        text=st.text.text,
        token_ids=seq.output_token_ids,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=st.logprobs,  # the sequence is done: nobody appends to it any more
    )
    _take_delta(seq, co)
    return co


def _take_delta(seq: Seq, co: CompletionOutput) -> None:
    st: SeqOutputState = seq.out
    co.delta_text = st.text.pop_delta(seq.finish_reason is not None)
    # Sliced from the whole token list: no copy of the output tokens is made to find it.
    co.delta_token_ids = seq.token_ids[seq.prompt_len + st.sent_tokens :]
    st.sent_tokens += len(co.delta_token_ids)
    if st.logprobs is not None:
        co.delta_logprobs = st.logprobs[st.sent_logprobs :]
        st.sent_logprobs = len(st.logprobs)


def request_final_output(req: Request) -> RequestOutput:
    """A finished request's output: everything cumulative, the last delta, and the metrics."""
    seqs = req.seqs
    firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
    scheds = [s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None]
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        outputs=[final_output(s) for s in seqs],
        finished=True,
        num_cached_tokens=seqs[0].num_cached_tokens,
        prompt_logprobs=take_prompt_logprobs(seqs[0], final=True),
        embedding=seqs[0].out.embedding,
        metrics=RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=min(scheds) if scheds else None,
            first_token_time=min(firsts) if firsts else None,
            finished_time=time.monotonic(),
            token_times=sorted(t for s in seqs for t in s.token_times),
            num_prompt_tokens=len(req.prompt_token_ids),
            num_generation_tokens=sum(s.num_output_tokens for s in seqs),
            num_cached_tokens=seqs[0].num_cached_tokens,
        ),
    )


def request_delta_output(req: Request) -> RequestOutput:
    """A running DELTA request's output: what changed this step, nothing cumulative."""
    return RequestOutput(
        request_id=req.request_id,
        prompt=None,
        prompt_token_ids=[],
        outputs=[delta_output(s) for s in req.seqs],
        num_cached_tokens=req.seqs[0].num_cached_tokens,
        prompt_logprobs=take_prompt_logprobs(req.seqs[0], final=False),
    )
