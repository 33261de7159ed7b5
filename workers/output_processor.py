"""Per-sequence output state: incremental text, stop conditions, logprobs, streaming deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.outputs import CompletionOutput, TokenLogprobs
from workers.request import Sequence


@dataclass(eq=False)
class SeqOutputState:
    detok: object  # IncrementalDetokenizer
    stop_strings: list[str]
    holdback: int  # chars held back while streaming: a stop string may still be forming
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    sent_text: int = 0  # chars already yielded
    sent_tokens: int = 0
    sent_logprobs: int = 0
    special_stop: set[int] = field(default_factory=set)


def new_output_state(seq: Sequence, tokenizer) -> SeqOutputState:  # noqa: ANN001
    from workers.detokenizer import IncrementalDetokenizer

    p = seq.params
    stops = list(p.stop or [])
    return SeqOutputState(
        detok=IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, p.skip_special_tokens),
        stop_strings=stops,
        holdback=max((len(s) for s in stops), default=1) - 1,
        logprobs=[] if p.logprobs is not None else None,
        special_stop=set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(p.eos_token_ids)),
    )


def process_token(
    seq: Sequence, token: int, logprobs: TokenLogprobs | None, max_model_len: int
) -> None:
    """Appends one sampled token's text and decides whether the sequence stops."""
    st: SeqOutputState = seq.out
    p = seq.params
    n_out = seq.num_output_tokens  # the token is already in seq.token_ids
    if st.logprobs is not None and logprobs is not None:
        st.logprobs.append(logprobs)
    past_min = n_out >= p.min_tokens
    if past_min and token in st.special_stop:
        seq.finish_reason = "stop"
        seq.stop_reason = None if token in p.eos_token_ids and not p.stop_token_ids else token
        if p.stop_token_ids and token in p.stop_token_ids:
            seq.stop_reason = token
        st.detok.step([token])  # keep the detokenizer's window consistent; text not shown
        return
    prev_len = len(st.text)
    st.text += st.detok.step([token])
    if st.stop_strings and past_min:
        # Search only the new tail (plus enough before it for a stop spanning tokens).
        start = max(0, prev_len - st.holdback)
        best: tuple[int, str] | None = None
        for s in st.stop_strings:
            i = st.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            st.text = st.text[: i + len(s)] if p.include_stop_str_in_output else st.text[:i]
            seq.finish_reason, seq.stop_reason = "stop", s
            return
    if p.max_tokens is not None and n_out >= p.max_tokens:
        seq.finish_reason = "length"
    elif seq.num_tokens >= max_model_len:
        seq.finish_reason = "length"


def completion_output(seq: Sequence, delta: bool) -> CompletionOutput:
    """The sequence's cumulative output plus, when `delta`, what changed since the last one."""
    st: SeqOutputState = seq.out
    out_ids = seq.output_token_ids
    finished = seq.finish_reason is not None
    visible = len(st.text) if finished or not st.stop_strings else max(
        st.sent_text, len(st.text) - st.holdback
    )
    text = st.text if finished else st.text[:visible]
    co = CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=list(out_ids),
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=list(st.logprobs) if st.logprobs is not None else None,
    )
    if delta:
        co.delta_text = text[st.sent_text :]
        co.delta_token_ids = out_ids[st.sent_tokens :]
        if st.logprobs is not None:
            co.delta_logprobs = st.logprobs[st.sent_logprobs :]
        st.sent_text, st.sent_tokens = len(text), len(out_ids)
        st.sent_logprobs = len(st.logprobs) if st.logprobs is not None else 0
    return co
