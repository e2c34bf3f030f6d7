"""The first request in a fresh process or server: stock against suffix
decoding, pairs interleaved (arm order alternates), greedy, outputs compared.

    python benchmarks/first_request.py MODEL PROMPT_FILE [--max-tokens 100]
        [--entry generate|stream|server] [--pairs 2]

MODEL: a folder, Hugging Face id or real model name (``smollm2``,
``smollm2-f32``, ...). ``generate`` times the whole ``mlx_lm.generate``
command (load included), ``stream`` one ``stream_generate`` call after the
load, ``server`` the first chat request to a fresh ``mlx_lm.server`` (the
stock server, ``--draft suffix`` for the suffix arm). Prints each arm's
seconds and each pair's ratio (suffix / stock). Results: docs/real-model.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from typing import Tuple

from mlx_lm_suffix.tools.launcher import ServerProcess
from mlx_lm_suffix.tools.models import resolve_model

STREAM = r"""
import sys, time, mlx_lm
from mlx_lm import stream_generate
from mlx_lm_suffix import SuffixDrafter
model, tokenizer = mlx_lm.load(sys.argv[1])
messages = [{"role": "user", "content": open(sys.argv[2]).read()}]
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
kw = {"draft_model": SuffixDrafter()} if sys.argv[4] == "suffix" else {}
tic = time.perf_counter()
tokens = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=int(sys.argv[3]), **kw)]
print("RESULT", time.perf_counter() - tic, " ".join(map(str, tokens)))
"""


def run(entry: str, arm: str, model: str, prompt_file: str, max_tokens: int) -> Tuple[float, str]:
    """Seconds the arm took and what it generated."""
    prompt = open(prompt_file).read()
    if entry == "generate":
        cmd = [sys.executable, "-m", "mlx_lm", "generate", "--model", model]
        cmd += ["--prompt", prompt, "--max-tokens", str(max_tokens)]
        cmd += ["--suffix-draft"] if arm == "suffix" else []
        tic = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        return time.perf_counter() - tic, out.split("==========")[1]
    if entry == "stream":
        args = [model, prompt_file, str(max_tokens), arm]
        out = subprocess.run([sys.executable, "-c", STREAM, *args], capture_output=True, text=True)
        line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT")).split(" ", 2)
        return float(line[1]), line[2]
    extra = ("--draft", "suffix") if arm == "suffix" else ()
    with ServerProcess(model, *extra) as server:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
        request = urllib.request.Request(
            server.url + "/v1/chat/completions",
            json.dumps({**body, "temperature": 0}).encode(),
            {"Content-Type": "application/json"},
        )
        tic = time.perf_counter()
        reply = json.load(urllib.request.urlopen(request, timeout=3600))
        return time.perf_counter() - tic, reply["choices"][0]["message"]["content"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("prompt_file")
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--entry", choices=("generate", "stream", "server"), default="generate")
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    model = str(resolve_model(args.model))
    for pair in range(args.pairs):
        got = {}
        for arm in ("stock", "suffix") if pair % 2 == 0 else ("suffix", "stock"):
            got[arm] = run(args.entry, arm, model, args.prompt_file, args.max_tokens)
            print(f"pair {pair}: {arm} {got[arm][0]:.2f} s", flush=True)
        same = "same output" if got["suffix"][1] == got["stock"][1] else "OUTPUTS DIFFER"
        print(f"pair {pair}: suffix / stock {got['suffix'][0] / got['stock'][0]:.3f}, {same}")


if __name__ == "__main__":
    main()
