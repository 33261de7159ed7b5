"""OpenAI response bodies built from engine RequestOutputs (plain dicts: cheap per SSE chunk).

With a reasoning parser on, a chat message carries its thinking in `reasoning_content`
(vLLM's field) and its answer in `content`; streamed, `reasoning_content` deltas come first,
then `content` (cluster/ingress/reasoning.py). With it off, nothing changes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cluster.http import echo as echoes
from cluster.http.tool_stream import ToolStream
from cluster.ingress.reasoning import AnswerReader, Thought
from cluster.ingress.token_text import TokenStrings
from cluster.ingress.tool_calls import ToolCall, finish_reason
from workers.outputs import CompletionOutput, RequestOutput, TokenLogprobs

if TYPE_CHECKING:
    from cluster.http.echo import PromptEcho
    from cluster.ingress.output_parsing import Reasoning
    from cluster.ingress.tools import ToolUse


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def request_usage(outs: Sequence[RequestOutput], scoring_only: bool = False) -> dict[str, Any]:
    """Usage summed over the finished outputs of one API request (one per prompt); a
    scoring-only answer (echo, max_tokens 0) shows no completion tokens and counts none."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = 0 if scoring_only else sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    return usage(prompt, completion, cached)


def _top(lp: TokenLogprobs, n: int) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: kv[1], reverse=True)[:n]


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs],
    top_n: int,
    tok: TokenStrings,
    offset: int = 0,
) -> dict[str, Any]:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp in zip(token_ids, logprobs, strict=False):
        s = tok(tid)
        tokens.append(s)
        token_lps.append(lp.get(tid))
        tops.append({tok(t): v for t, v in _top(lp, top_n)} if top_n else None)
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs], top_n: int, tok: TokenStrings
) -> dict[str, Any]:
    """Chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""

    def entry(tid: int, value: float | None) -> dict[str, Any]:
        s = tok(tid)
        return {"token": s, "logprob": value, "bytes": list(s.encode("utf-8"))}

    content = []
    for tid, lp in zip(token_ids, logprobs, strict=False):
        item = entry(tid, lp.get(tid))
        item["top_logprobs"] = [entry(t, v) for t, v in _top(lp, top_n)]
        content.append(item)
    return {"content": content}


class Formatter:
    """Builds one API request's bodies; `kind` is "completion" or "chat"."""

    def __init__(
        self,
        kind: str,
        request_id: str,
        model: str,
        n: int,
        top_logprobs: int | None,
        tok: TokenStrings,
        tools: ToolUse | None = None,
        echo: PromptEcho | None = None,
        prompt_logprobs: int | None = None,
        reasoning: Reasoning | None = None,
    ) -> None:
        self.kind = kind
        self.id = request_id
        self.model = model
        self.n = n
        self.top_logprobs = top_logprobs  # None: no logprobs
        self.tok = tok
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # text offset per choice (completions logprobs)
        self._started: set[int] = set()  # chat choices that got their role delta
        self._done: set[int] = set()  # choices whose finish chunk went out
        # Chat with tools (not tool_choice none): each choice's output is read for calls.
        self.tools = tools if tools is not None and tools.parses else None
        self._tool_streams: dict[int, ToolStream] = {}
        # A chat's reasoning (cluster/ingress/output_parsing.py); None: the parser is off.
        self.reasoning = reasoning if kind == "chat" else None
        # Completions' echo (cluster/http/echo.py); vLLM's prompt_logprobs field (top N).
        self.echo = echo
        self.prompt_logprobs = prompt_logprobs
        self._prompt_lps: dict[int, Any] = {}  # streamed: each prompt's, once the engine sent them

    @property
    def scoring_only(self) -> bool:
        return self.echo is not None and self.echo.scoring_only

    def _computed_n(self) -> int:
        """How many best tokens the engine ranked at each prompt position."""
        echoed = self.top_logprobs if self.echo is not None else None
        return max(n for n in (self.prompt_logprobs, echoed, 0) if n is not None)

    def _message(self, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """A chat choice's message and finish_reason (tool calls read out when asked for, the
        reasoning split off with the parser on)."""
        if self.tools is None and self.reasoning is None:
            return {"role": "assistant", "content": c.text}, c.finish_reason
        parser = self.tools.parser() if self.tools is not None else None
        events = AnswerReader(self.reasoning, parser).feed(c.text, finished=True)
        calls = [e for e in events if isinstance(e, ToolCall)]
        content = "".join(e for e in events if isinstance(e, str)) or None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            thought = "".join(e.text for e in events if isinstance(e, Thought))
            message["reasoning_content"] = thought or None
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        return message, finish_reason(c.finish_reason, len(calls))

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(
        self,
        c: CompletionOutput,
        ids: Sequence[int],
        lps: Sequence[TokenLogprobs] | None,
        index: int,
    ) -> Any:
        if self.top_logprobs is None or lps is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(ids, lps, self.top_logprobs, self.tok)
        # With echo the completion's text starts after the prompt's.
        start = len(self.echo.texts[index // self.n]) if self.echo is not None else 0
        offset = self._offsets.get(index, start)
        out = completion_logprobs(ids, lps, self.top_logprobs, self.tok, offset)
        self._offsets[index] = offset + sum(len(t) for t in out["tokens"])
        return out

    # -- whole responses -------------------------------------------------------------------

    def response(self, outs: Sequence[RequestOutput]) -> dict[str, Any]:
        """The non-streaming body; `outs` are the final outputs, one per prompt."""
        choices = []
        for p, out in enumerate(outs):
            for c in out.outputs:
                index = p * self.n + c.index
                lps = self._logprobs(c, c.token_ids, c.logprobs, index)
                if self.kind == "chat":
                    message, finish = self._message(c)
                    choices.append(
                        {
                            "index": index,
                            "message": message,
                            "logprobs": lps,
                            "finish_reason": finish,
                        }
                    )
                else:
                    choices.append(self._completion_choice(p, out, c, index, lps))
        choices.sort(key=lambda ch: ch["index"])
        body = self._base("chat.completion" if self.kind == "chat" else "text_completion")
        body["choices"] = choices
        body["usage"] = request_usage(outs, self.scoring_only)
        if self.kind == "chat" and self.prompt_logprobs is not None and outs:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(outs[0])
        return body

    def _completion_choice(
        self, p: int, out: RequestOutput, c: CompletionOutput, index: int, lps: Any
    ) -> dict[str, Any]:
        text, finish = c.text, c.finish_reason
        if self.echo is not None:
            prompt = self.echo.texts[p]
            text = prompt if self.scoring_only else prompt + text
            finish = self.echo.finish_reason(finish)
            if self.top_logprobs is not None:
                lps = self._echo_logprobs(p, out.prompt_logprobs, lps)
        choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": finish}
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(out)
        return choice

    def _echo_logprobs(self, p: int, prompt_lps: Any, completion: Any) -> dict[str, Any]:
        """The prompt's logprobs, then (unless scoring only) the completion's."""
        assert self.echo is not None and self.top_logprobs is not None
        head = self.echo.logprobs(p, prompt_lps, self.top_logprobs, self.tok)
        return echoes.join_logprobs(head, None if self.scoring_only else completion)

    def _vllm_prompt_logprobs(self, out: RequestOutput) -> Any:
        assert self.prompt_logprobs is not None
        return echoes.vllm_prompt_logprobs(
            out.prompt_token_ids,
            out.prompt_logprobs,
            self.prompt_logprobs,
            self.tok,
            self._computed_n(),
        )

    # -- streaming -------------------------------------------------------------------------

    def chunks(self, out: RequestOutput, prompt_index: int = 0) -> list[str]:
        """SSE frames for one engine yield: one chunk per choice that changed."""
        frames = []
        if out.prompt_logprobs is not None:  # the first output after the prompt has them
            self._prompt_lps.setdefault(prompt_index, out.prompt_logprobs)
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            if index in self._done:
                continue  # later yields repeat a finished choice's cumulative state
            finish = c.finish_reason
            if finish is not None:
                self._done.add(index)
            if self.echo is not None:
                frame = self._echo_chunk(c, prompt_index, index)
                if frame is not None:
                    frames.append(frame)
                continue
            with_lps = self.top_logprobs is not None and bool(c.delta_token_ids)
            first = self.kind == "chat" and index not in self._started
            # Nothing visible yet (e.g. bytes of a multi-byte character held back): skip.
            if not (c.delta_text or finish or with_lps or first):
                continue
            lps = (
                self._logprobs(c, c.delta_token_ids, c.delta_logprobs, index) if with_lps else None
            )
            if self.kind == "chat" and (self.tools is not None or self.reasoning is not None):
                frames.extend(self._tool_chunks(c, index, first, lps))
                continue
            if self.kind == "chat":
                delta: dict[str, Any] = {"content": c.delta_text}
                if first:
                    self._started.add(index)
                    delta = {"role": "assistant", **delta}
                choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}
                body = self._base("chat.completion.chunk")
            else:
                choice = {
                    "index": index,
                    "text": c.delta_text,
                    "logprobs": lps,
                    "finish_reason": finish,
                }
                body = self._base("text_completion")
            body["choices"] = [choice]
            frames.append(sse(body))
        return frames

    def _echo_chunk(self, c: CompletionOutput, p: int, index: int) -> str | None:
        """A streamed completions choice with echo: its first chunk starts with the prompt
        (and its logprobs); a scoring-only choice shows nothing of the sampled token."""
        assert self.echo is not None
        first = index not in self._started
        self._started.add(index)
        text = "" if self.scoring_only else c.delta_text
        with_lps = self.top_logprobs is not None and bool(c.delta_token_ids)
        with_lps = with_lps and not self.scoring_only
        finish = self.echo.finish_reason(c.finish_reason)
        if not (first or text or finish or with_lps):
            return None
        lps = self._logprobs(c, c.delta_token_ids, c.delta_logprobs, index) if with_lps else None
        if first:
            text = self.echo.texts[p] + text
            if self.top_logprobs is not None:
                lps = self._echo_logprobs(p, self._prompt_lps.get(p), lps)
        body = self._base("text_completion")
        body["choices"] = [{"index": index, "text": text, "logprobs": lps, "finish_reason": finish}]
        return sse(body)

    def _tool_chunks(self, c: CompletionOutput, index: int, first: bool, lps: Any) -> list[str]:
        """A chat choice's frames when its output is read for tool calls or reasoning:
        reasoning, content and call deltas (cluster/http/tool_stream.py), logprobs on the
        first, finish on the last."""
        stream = self._tool_streams.get(index)
        if stream is None:
            parser = self.tools.parser() if self.tools is not None else None
            stream = self._tool_streams[index] = ToolStream(parser, self.reasoning)
        finish = c.finish_reason
        deltas = stream.deltas(c.delta_text, finish is not None)
        if first:
            self._started.add(index)
            text = bool(deltas) and ("content" in deltas[0] or "reasoning_content" in deltas[0])
            head = deltas[0] if text else {"content": ""}
            if deltas and head is deltas[0]:
                deltas[0] = {"role": "assistant", **head}
            else:
                deltas.insert(0, {"role": "assistant", **head})
        if not deltas and (finish is not None or lps is not None):
            deltas = [{}]
        reason = stream.finish_reason(finish)
        frames = []
        for i, delta in enumerate(deltas):
            body = self._base("chat.completion.chunk")
            last = i == len(deltas) - 1
            body["choices"] = [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": lps if i == 0 else None,
                    "finish_reason": reason if last else None,
                }
            ]
            frames.append(sse(body))
        return frames

    def usage_chunk(self, outs: Sequence[RequestOutput]) -> str:
        body = self._base("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = []
        body["usage"] = request_usage(outs, self.scoring_only)
        return sse(body)


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
