"""Suffix decoding from Python: one SuffixDrafter shared across a chat.

Each turn's prompt holds the previous answer, so the drafter finds long
matches in the prompt and in its cache of earlier answers. Tokens stream to
stdout; at the end the drafter's stats are printed next to a run of stock
``mlx_lm.stream_generate`` on the same prompts, and the greedy texts are
compared (exit status 1 if they differ).

Run (offline, on the embedded random-weight demo model):

    python examples/stream_generate.py
    python examples/stream_generate.py --model mlx-community/Qwen3-0.6B-4bit --turns 4
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx
import mlx_lm

from mlx_lm_suffix import SuffixDrafter
from mlx_lm_suffix.tools.models import ensure_model

QUESTIONS = [
    "Write a Python function that parses a CSV line into a list of fields.",
    "Now add type hints to it.",
    "Now add a docstring, and keep everything else the same.",
    "Rename the function to split_csv_line and show the whole code again.",
]


def generate(
    model, tokenizer, prompt: str, max_tokens: int, drafter=None, echo: bool = True
) -> str:
    """The greedy answer to ``prompt``, streamed to stdout if ``echo``."""
    text = ""
    for response in mlx_lm.stream_generate(
        model, tokenizer, prompt, max_tokens=max_tokens, draft_model=drafter
    ):
        if echo:
            print(response.text, end="", flush=True)
        text += response.text
    if echo:
        print("\n")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model id or path (default: demo model)")
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--turns", type=int, default=len(QUESTIONS))
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--suffix-policy", choices=["adaptive", "fixed"], default="adaptive")
    args = parser.parse_args()

    model, tokenizer = mlx_lm.load(args.model or str(ensure_model("qwen3", "small")))
    if args.model is None:
        # float32 makes the drafted run exactly equal to plain decoding. In
        # bf16/fp16, verifying several tokens in one forward can round a
        # near-tie between two logits differently than one token at a time,
        # so a long greedy text may (rarely) differ after such a tie.
        model.set_dtype(mx.float32)

    # One drafter for the whole session: its cache of earlier answers grows.
    drafter = SuffixDrafter(num_draft_tokens=args.num_draft_tokens, policy=args.suffix_policy)
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a concise Python assistant."}
    ]
    prompts: list[str] = []
    start = time.perf_counter()
    for i in range(args.turns):
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(prompt)
        print(f"--- turn {i + 1}: {messages[-1]['content']}")
        answer = generate(model, tokenizer, prompt, args.max_tokens, drafter)
        messages.append({"role": "assistant", "content": answer})
    suffix_seconds = time.perf_counter() - start

    print("--- the same prompts with stock mlx_lm.stream_generate (no drafter)")
    start = time.perf_counter()
    baseline = [generate(model, tokenizer, p, args.max_tokens, echo=False) for p in prompts]
    stock_seconds = time.perf_counter() - start

    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    stats = drafter.snapshot()
    print(f"drafted tokens:   {stats['drafted']}")
    print(f"accepted tokens:  {stats['accepted']}")
    print(f"acceptance rate:  {stats['acceptance_rate']:.1%}")
    print(f"tokens per step:  {stats['tokens_per_step']:.2f}")
    print(f"time with suffix: {suffix_seconds:.2f}s, stock: {stock_seconds:.2f}s")
    match = answers == baseline
    print(f"texts match: {'yes' if match else 'no'}")
    return 0 if match else 1


if __name__ == "__main__":
    sys.exit(main())
