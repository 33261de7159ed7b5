"""The prompt in completion answers: `echo`, and vLLM's `prompt_logprobs` field.

`echo: true` on /v1/completions puts each prompt's text before its choices' text; with
`logprobs: k` the legacy `logprobs` object covers the prompt's tokens first (the first has
nothing before it to predict it: null logprob and null top_logprobs), then the completion's,
and `text_offset` is where each token starts in the choice's text. `max_tokens: 0` with echo
scores the prompt only: the engine still samples one token (it always does), which the answer
leaves out. vLLM's `prompt_logprobs: N` answers with a list per prompt, one entry per prompt
token (the first null), each `{token_id: {"logprob", "rank", "decoded_token"}}` (the prompt's
token first, then the top N): per choice on /v1/completions, top level on chat, as vLLM does.

`PromptEcho` is what the HTTP ingress knows of the prompts when it builds the answer (the
engine's streamed outputs do not repeat the prompt); cluster/http/format.py uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.ingress.prompts import off_loop
from workers.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from cluster.http.protocol import CompletionRequest
    from cluster.ingress.prepare import Prepared
    from cluster.ingress.prompts import Prompts
    from cluster.ingress.token_text import TokenStrings
    from workers.outputs import TokenLogprobs

PromptLogprobs = Sequence["TokenLogprobs | None"]

# What an impossible token's -inf logprob becomes: JSON has no infinity (vLLM and OpenAI
# answer the same number).
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class PromptEcho:
    """The prompts of one /v1/completions request with echo, in request order."""

    texts: tuple[str, ...]  # the prompt as sent, or its token ids decoded
    token_ids: tuple[tuple[int, ...], ...]
    # With logprobs: where each prompt token starts in its text. None without.
    offsets: tuple[tuple[int, ...], ...] | None
    scoring_only: bool  # max_tokens 0: the prompt alone, no completion

    def finish_reason(self, reason: str | None) -> str | None:
        """A scoring-only choice ends "length" (its budget of 0 tokens), unless aborted."""
        if self.scoring_only and reason in ("stop", "length"):
            return "length"
        return reason

    def logprobs(
        self, p: int, prompt_lps: PromptLogprobs | None, top_n: int, tok: TokenStrings
    ) -> dict[str, list[Any]]:
        """Legacy `logprobs` lists of prompt `p`'s tokens (none computed: all null)."""
        ids = self.token_ids[p]
        offsets = self.offsets[p] if self.offsets is not None else (0,) * len(ids)
        tokens, token_lps, tops = [], [], []
        for i, tid in enumerate(ids):
            lp = prompt_lps[i] if prompt_lps is not None and i < len(prompt_lps) else None
            tokens.append(tok(tid))
            if lp is None:
                token_lps.append(None)
                tops.append(None)
                continue
            value = lp.get(tid)
            token_lps.append(None if value is None else clamp(value))
            tops.append({tok(t): clamp(v) for t, v in ranked(lp)[:top_n]} if top_n else None)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": list(offsets),
        }


def join_logprobs(first: dict[str, list[Any]], then: dict[str, list[Any]] | None) -> dict:
    """Two legacy `logprobs` objects as one (the prompt's, then the completion's)."""
    if then is None:
        return first
    return {key: first[key] + then[key] for key in first}


async def prompt_echo(
    body: CompletionRequest, prepared: Prepared, prompts: Prompts
) -> PromptEcho | None:
    """The echo of a completions request (None without echo): texts, ids and, with logprobs,
    token offsets, computed off the event loop for long prompts."""
    if not body.echo:
        return None
    tokenizer = prompts.tokenizer
    ids = tuple(tuple(inp.prompt_token_ids) for inp in prepared.inputs)
    texts = []
    for sent, prompt_ids in zip(body.prompts(), ids, strict=True):
        if isinstance(sent, str):
            texts.append(sent)
        else:  # token ids: their text, special tokens kept (they are part of the prompt)
            texts.append(await off_loop(len(prompt_ids), tokenizer.decode, prompt_ids, False))
    offsets = None
    if body.logprobs is not None:
        # About 10 us per token (a few small decodes each): a long prompt leaves the loop.
        offsets = tuple(
            [
                tuple(await off_loop(8 * len(i), text_offsets, tokenizer, i, t))
                for i, t in zip(ids, texts, strict=True)
            ]
        )
    return PromptEcho(tuple(texts), ids, offsets, body.scoring_only)


def text_offsets(tokenizer: Any, ids: Sequence[int], text: str) -> list[int]:
    """Where each token starts in `text`: the characters the tokens before it decode to.

    Decoded incrementally (a token inside a multi-byte character starts where that character
    does), special tokens kept. Tokens the tokenizer put before the text (a BOS) start at 0;
    offsets never pass the end of `text`.
    """
    det = IncrementalDetokenizer(tokenizer, (), skip_special_tokens=False)
    offsets, parts, at = [], [], 0
    for tid in ids:
        offsets.append(at)
        delta = det.step([tid])
        parts.append(delta)
        at += len(delta)
    parts.append(det.flush())
    decoded = "".join(parts)
    shift = len(decoded) - len(text) if decoded != text and decoded.endswith(text) else 0
    return [min(max(0, o - shift), len(text)) for o in offsets]


def vllm_prompt_logprobs(
    ids: Sequence[int],
    prompt_lps: PromptLogprobs | None,
    top_n: int,
    tok: TokenStrings,
    computed_n: int,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id (a string,
    as JSON keys are): {"logprob", "rank", "decoded_token"}}, the prompt's token first, then
    the top `top_n`. `rank` is 1-based in the vocabulary; null for a prompt token outside the
    `computed_n` best the engine ranked."""
    if prompt_lps is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for i, tid in enumerate(ids):
        lp = prompt_lps[i] if i < len(prompt_lps) else None
        if lp is None:
            out.append(None)
            continue
        order = ranked(lp)
        rank = {t: r + 1 for r, (t, _) in enumerate(order[:computed_n])}
        shown = [(tid, lp[tid])] if tid in lp else []
        shown += [(t, v) for t, v in order[:top_n] if t != tid]
        out.append(
            {
                str(t): {"logprob": clamp(v), "rank": rank.get(t), "decoded_token": tok(t)}
                for t, v in shown
            }
        )
    return out


def ranked(lp: TokenLogprobs) -> list[tuple[int, float]]:
    """One position's tokens, most likely first."""
    return sorted(lp.items(), key=lambda kv: kv[1], reverse=True)


def clamp(value: float) -> float:
    return max(value, MIN_LOGPROB)
