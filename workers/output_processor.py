"""Per-sequence output state: text (via OutputText), stop conditions, logprobs, deltas."""

from __future__ import annotations

from dataclasses import dataclass

from workers.detokenizer import OutputText
from workers.outputs import CompletionOutput, TokenLogprobs
from workers.request import Sequence


@dataclass(eq=False)
class SeqOutputState:
    text: OutputText
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    logprobs: list[TokenLogprobs] | None = None
    sent_text: int = 0  # characters streamed so far
    sent_tokens: int = 0
    sent_logprobs: int = 0


def new_output_state(seq: Sequence, tokenizer) -> SeqOutputState:  # noqa: ANN001
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
    )


def process_token(
    seq: Sequence, token: int, logprobs: TokenLogprobs | None, max_model_len: int
) -> None:
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


def finish_abort(seq: Sequence) -> None:
    if seq.finish_reason is None:
        seq.finish_reason = "abort"
        seq.out.text.flush()


def completion_output(seq: Sequence, delta: bool) -> CompletionOutput:
    """The sequence's cumulative output plus, when `delta`, what changed since the last one."""
    st: SeqOutputState = seq.out
    out_ids = seq.output_token_ids
    finished = seq.finish_reason is not None
    co = CompletionOutput(
        index=seq.index,
        text=st.text.text,
        token_ids=out_ids,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=list(st.logprobs) if st.logprobs is not None else None,
    )
    if delta:
        co.delta_text = st.text.pop_delta(finished)
        st.sent_text += len(co.delta_text)
        co.delta_token_ids = out_ids[st.sent_tokens :]
        st.sent_tokens = len(out_ids)
        if st.logprobs is not None:
            co.delta_logprobs = st.logprobs[st.sent_logprobs :]
            st.sent_logprobs = len(st.logprobs)
        if not finished:
            # While streaming, the cumulative text is what has been shown so far.
            co.text = st.text.text[: st.sent_text]
    return co
