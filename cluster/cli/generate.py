"""`kvray generate [--model DIR|FILE.gguf] PROMPT`: offline generation streamed to stdout."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text (use --chat to wrap it in the chat template)")
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face checkpoint directory or .gguf file (default: the built-in demo model)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="Hugging Face tokenizer directory (default: the model's; a .gguf file's own)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="send PROMPT as a user message through the model's chat template",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); higher = more random"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p filter (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="TP ranks (default 1)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")


def run(args: argparse.Namespace) -> int:
    import logging

    from workers.config import EngineArgs
    from workers.core.engine import LLMEngine
    from workers.sampling_params import SamplingParams

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
        engine = LLMEngine.from_args(
            EngineArgs(
                model=args.model,
                tokenizer=args.tokenizer,
                tensor_parallel_size=args.tensor_parallel_size,
                dtype=args.dtype,
            ),
            progress=True,
        )
        prompt: str | list[int] = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}]
            )
        engine.add_prompt("generate-0", prompt, params)
    except ValueError as e:
        print(f"kvray generate: error: {e}", file=sys.stderr)
        return 2
    try:
        while engine.has_unfinished():
            for out in engine.step():
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        engine.shutdown()
    return 0
