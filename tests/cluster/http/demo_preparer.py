"""The ingress's request preparation on the demo model, without Ray: what the tests of the
second API shapes (Responses, Messages) compare with the chat request they translate to."""

from __future__ import annotations

import asyncio
from typing import Any

from cluster.http.protocol import ChatCompletionRequest
from cluster.ingress.limits import DEFAULT_LIMITS
from cluster.ingress.prepare import Prepared, Preparer
from cluster.ingress.prompts import Prompts
from workers.inputs import InputChecker


class DemoLimits:
    """What LLMClient.input_checker gives the preparer: the demo model's input checker."""

    def __init__(self, vocab_size: int) -> None:
        self.checker = InputChecker(vocab_size=vocab_size, max_model_len=2048)

    async def input_checker(self) -> InputChecker:
        return self.checker


def demo_preparer() -> Preparer:
    from workers.demo import demo_model_dir
    from workers.tokenizer import Tokenizer

    prompts = Prompts(Tokenizer.from_pretrained(demo_model_dir()))
    return Preparer(prompts, DemoLimits(prompts.vocab_size), DEFAULT_LIMITS)


def prepare_chat(preparer: Preparer, **kw: Any) -> Prepared:
    """The chat completions request `kw`, prepared."""
    return asyncio.run(preparer.prepare(ChatCompletionRequest(**kw)))
