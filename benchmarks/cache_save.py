"""Saving a large suffix cache: how long a save of a ~4M-token cache takes,
and the longest gap a generation loop running beside it sees meanwhile.

    python benchmarks/cache_save.py [--responses 10000] [--tokens 400]
        [--reps 2] [--model qwen3] [--baseline-s 2]

Builds a SuffixDrafter holding ``responses`` cached responses of ``tokens``
random ids each (below 150000), then, while a thread decodes greedily with
the tiny random-weight model (``mlx_lm.generate.generate_step``, one token at
a time, as a server's generation thread does), saves the cache with
``persistence.save_cache_file`` (what ``--suffix-cache-file``'s background
saver runs). Prints per repetition the save's seconds, the file's size, the
longest gap between two generated tokens (and the tokens per second) during
the save and in the ``baseline-s`` seconds before it (the machine's own
noise), and the time to read the file back with all checks. Results: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from typing import Dict, List

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.generate import generate_step

from mlx_lm_suffix import SuffixDrafter
from mlx_lm_suffix.persistence import read_cache_file, save_cache_file
from mlx_lm_suffix.tools.models import ensure_model

MODEL_ID = "benchmark-cache-save"
MAX_ID = 150000


def build_drafter(responses: int, tokens: int, seed: int = 0) -> SuffixDrafter:
    """A drafter whose global cache holds ``responses`` random responses."""
    rng = np.random.default_rng(seed)
    drafter = SuffixDrafter(max_cached_requests=responses, max_cached_tokens=responses * tokens)
    drafter.add_responses(
        (None, rng.integers(0, MAX_ID, tokens).tolist()) for _ in range(responses)
    )
    return drafter


class Generator(threading.Thread):
    """Greedy decoding in a thread, noting each token's time."""

    def __init__(self, model_path: str):
        super().__init__(daemon=True)
        self.model, self.tokenizer = mlx_lm.load(model_path)
        self.times: List[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        prompt = mx.array(self.tokenizer.encode("one two three " * 8))
        while not self.stop.is_set():
            for _ in generate_step(prompt, self.model, max_tokens=2000):
                self.times.append(time.perf_counter())
                if self.stop.is_set():
                    return

    def longest_gap(self, start: float, end: float) -> float:
        """The longest time between two tokens, or from ``start`` to the
        first token or from the last to ``end``, within [start, end]."""
        inside = [t for t in self.times if start <= t <= end]
        points = [start, *inside, end]
        return max(b - a for a, b in zip(points, points[1:]))

    def tokens_between(self, start: float, end: float) -> int:
        return sum(start <= t <= end for t in self.times)


def measure(
    drafter: SuffixDrafter, gen: Generator, path: str, baseline_s: float
) -> Dict[str, float]:
    """One save while ``gen`` runs."""
    time.sleep(baseline_s)
    start = time.perf_counter()
    save_cache_file(drafter, path, MODEL_ID)
    end = time.perf_counter()
    time.sleep(0.2)  # a token after the save ends the last gap
    tic = time.perf_counter()
    read = read_cache_file(path, MODEL_ID, vocab_size=MAX_ID)
    read_s = time.perf_counter() - tic
    assert len(read) == drafter.cached_requests
    return {
        "save_s": end - start,
        "file_mb": os.path.getsize(path) / 1e6,
        "gap_during_ms": 1000 * gen.longest_gap(start, end),
        "gap_before_ms": 1000 * gen.longest_gap(start - baseline_s, start),
        "tokens_per_s_during": gen.tokens_between(start, end) / (end - start),
        "tokens_per_s_before": gen.tokens_between(start - baseline_s, start) / baseline_s,
        "read_s": read_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--responses", type=int, default=10000)
    ap.add_argument("--tokens", type=int, default=400, help="tokens per response")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--model", default="qwen3", help="family of the tiny model that generates")
    ap.add_argument("--baseline-s", type=float, default=2.0)
    args = ap.parse_args()
    tic = time.perf_counter()
    drafter = build_drafter(args.responses, args.tokens)
    print(
        f"cache: {drafter.cached_requests} responses, {drafter.cached_tokens} tokens "
        f"(built in {time.perf_counter() - tic:.1f} s)"
    )
    gen = Generator(str(ensure_model(args.model, "tiny")))
    gen.start()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cache.json")
        for rep in range(args.reps):
            r = measure(drafter, gen, path, args.baseline_s)
            print(
                f"rep {rep + 1}: save {r['save_s']:.2f} s, file {r['file_mb']:.1f} MB; "
                f"longest gap between tokens during the save {r['gap_during_ms']:.0f} ms "
                f"({r['tokens_per_s_during']:.0f} tokens/s), in the {args.baseline_s:g} s "
                f"before {r['gap_before_ms']:.0f} ms ({r['tokens_per_s_before']:.0f} tokens/s); "
                f"read back {r['read_s']:.2f} s"
            )
    gen.stop.set()
    gen.join()


if __name__ == "__main__":
    main()
