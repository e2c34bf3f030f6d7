"""Pick suffix-decoding settings for ``mlx_lm.server`` from a request log.

Replays a JSONL log of earlier requests (one ``{"prompt": str, "response":
str}`` object per line, optional ``"user"``) through the drafter for every
point of a small grid of settings, offline and without running a model, then
prints the table and the recommended server command line.

Run (the shipped sample log holds stdlib functions and edited versions of
them, as a coding assistant would see):

    python examples/tune_from_log.py
    python examples/tune_from_log.py my_log.jsonl --model mlx-community/Qwen3-4B-4bit
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mlx_lm_suffix.tools.simulate import (
    format_table,
    read_records,
    recommend,
    server_command,
    simulate,
)

GRID = {
    "num_draft_tokens": [4, 8, 16],
    "max_tree_depth": [24, 64],
    "max_spec_factor": [1.0, 2.0],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "log", nargs="?", default=Path(__file__).with_name("sample_log.jsonl"), type=Path
    )
    parser.add_argument(
        "--model",
        help="model whose tokenizer counts tokens (folder or Hugging Face id); "
        "default: the demo model's tokenizer",
    )
    parser.add_argument("--max-records", type=int, help="replay only the first N records")
    args = parser.parse_args()

    records = read_records(args.log)[: args.max_records]
    results = simulate(records, GRID, tokenizer=args.model)
    print(format_table(results))
    best = recommend(results)
    print(
        f"\n{len(records)} requests: best {best['est_speedup']:.2f}x estimated speedup, "
        f"{best['acceptance_rate']:.1%} of drafted tokens accepted, "
        f"{best['tokens_per_step']:.2f} tokens/step"
    )
    print("Recommended command:")
    print(server_command(best, model=args.model))


if __name__ == "__main__":
    main()
