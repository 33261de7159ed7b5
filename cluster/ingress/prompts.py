"""Prompts into token ids at the ingress, the same way for HTTP and gRPC.

Both ingresses tokenize (text, and chat through the checkpoint's template) so the
prefix-affinity router sees token ids and the engine replicas spend no time on it. Whether
the ids fit the vocabulary and the context is checked next, by `workers.inputs.InputChecker`
(see cluster/ingress/checks.py); here only what is the ingress's own: empty inputs, template
errors, and the field each error names.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from cluster.errors import InvalidRequestError

T = TypeVar("T")

# Inputs this long (characters) are tokenized on a worker thread, so one huge prompt does not
# stall every other stream this ingress replica is serving; shorter ones are cheaper inline.
OFF_LOOP_CHARS = 16384


# What the template's caller sets itself (transformers' apply_chat_template arguments): a
# request's chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class Prompts:
    """Token ids of prompts, with the served checkpoint's tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # workers.tokenizer.Tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    async def text(self, text: str, field: str = "prompt", allow_empty: bool = False) -> list[int]:
        if not text and not allow_empty:
            raise InvalidRequestError(field, f"{field} must not be empty")
        return list(await off_loop(len(text), self.tokenizer.encode, text))

    async def chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        field: str = "messages",
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The chat rendered with the checkpoint's template, as token ids; `tools` (OpenAI
        tool dicts) are passed to the template, which lists them for the model, and so are
        `template_kwargs` (the request's `chat_template_kwargs`, e.g. enable_thinking), which
        cannot replace the variables set here."""
        size = sum(len(m.get("content") or "") for m in messages)
        taken = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or {}))
        if taken:
            raise InvalidRequestError(
                "chat_template_kwargs",
                f"chat_template_kwargs cannot set {', '.join(taken)} (the request sets it)",
            )
        kwargs: dict[str, Any] = dict(template_kwargs or {})
        kwargs["add_generation_prompt"] = add_generation_prompt
        if tools:
            kwargs["tools"] = tools
            size += sum(len(str(t)) for t in tools)
        try:
            ids = await off_loop(size, self.tokenizer.apply_chat_template, messages, **kwargs)
        except ValueError as err:  # no template, or the template refused the messages
            raise InvalidRequestError(field, str(err)) from None
        return list(ids)

    async def prompt(self, prompt: str | Sequence[int], field: str = "prompt") -> list[int]:
        """Text or token ids; the ids' range is InputChecker's to check."""
        if isinstance(prompt, str):
            return await self.text(prompt, field)
        if not prompt:
            raise InvalidRequestError(field, f"{field} must not be empty")
        return list(prompt)

    async def batch(
        self, prompts: Sequence[str | Sequence[int]], field: str = "prompt"
    ) -> list[list[int]]:
        """A /v1/completions batch: like `prompt` for each, but on one worker thread when the
        batch's text is long in total (many prompts just under OFF_LOOP_CHARS each would
        otherwise all be tokenized on the event loop)."""
        for p in prompts:
            if not p:
                raise InvalidRequestError(field, f"{field} must not be empty")
        size = sum(len(p) for p in prompts if isinstance(p, str))
        return await off_loop(size, self._encode_all, prompts)

    def _encode_all(self, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
        return [list(self.tokenizer.encode(p)) if isinstance(p, str) else list(p) for p in prompts]

    async def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (/detokenize), off the event loop when there are many."""
        return str(await off_loop(len(ids), self.tokenizer.decode, ids))

    def token_ids(self, ids: Sequence[int], field: str) -> list[int]:
        """Token ids that are not a prompt (detokenize, tokenize's echo): the vocabulary only."""
        vocab = self.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError(field, f"{field} must be token ids in [0, {vocab})")
        return list(ids)


async def off_loop(size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs), on a worker thread when the input is `size` >= OFF_LOOP_CHARS."""
    if size < OFF_LOOP_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)
