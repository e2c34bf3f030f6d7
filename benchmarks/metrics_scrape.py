"""A Prometheus scrape of a ``--draft suffix`` server under the bench's
agentic load, against the responses' ``usage`` and ``GET /v1/suffix/stats``.

    python benchmarks/metrics_scrape.py [--size tiny] [--requests 48]
        [--concurrency 8] [--max-tokens 96] [--passes 2] [--policy adaptive]

The bench's agentic workload in scripted mode (the answers follow its
references), sent by the bench's own client (``run_server_arms``: sessions
in waves of ``--concurrency``, each turn streamed with its usage), once
cold and then again warm (``--passes``). Prints each counter as the
responses' usage sums it, as ``/metrics`` counts it and as the stats
endpoint does, and the scrape's spec-decode lines; exits 1 on any
difference. Results: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

from mlx_lm_suffix.metrics import samples, total
from mlx_lm_suffix.tools import bench, workloads
from mlx_lm_suffix.tools.models import ensure_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--policy", default="adaptive", help="--suffix-policy of the server")
    args = parser.parse_args()

    from mlx_lm.utils import load_tokenizer

    model = str(ensure_model("qwen3", args.size))
    tokenizer = load_tokenizer(model)
    requests = bench.load_requests(workloads.build("agentic", args.requests), tokenizer)
    work = Path(tempfile.mkdtemp(prefix="metrics-scrape-"))
    script = bench.write_script(work / "script.jsonl", requests)
    sums = dict.fromkeys(("requests", "drafted", "accepted", "tokens", "prompt_tokens"), 0)
    with bench.server_process(model, suffix=True, script=script, eos_id=tokenizer.eos_token_id,
                              extra_args=["--suffix-policy", args.policy],
                              log=work / "server.log") as server:
        for p in range(args.passes):
            run = bench.run_server_arms({"suffix": server.url}, requests, args.max_tokens,
                                        args.concurrency, scripted=True)["suffix"]
            print(f"pass {p + 1}: {run['requests']} requests, {run['tokens']} tokens in "
                  f"{run['seconds']:.1f} s, drafted {run['drafted']}, accepted {run['accepted']}, "
                  f"answers followed the references: {run['matched_reference']}")
            for key in sums:
                sums[key] += run[key]
        stats = bench.server_stats(server.url)
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
    m = samples(text)
    spec = "mlx_lm_suffix_spec_decode_num_"
    rows = [
        ("draft tokens", sums["drafted"], total(m, spec + "draft_tokens_total"), stats["drafted"]),
        ("accepted tokens", sums["accepted"], total(m, spec + "accepted_tokens_total"),
         stats["accepted"]),
        ("accepted, over positions", sums["accepted"],
         total(m, spec + "accepted_tokens_per_pos_total"), stats["accepted"]),
        ("requests", sums["requests"], total(m, "mlx_lm_suffix_requests_total"),
         stats["requests"]),
        ("generated tokens", sums["tokens"], total(m, "mlx_lm_suffix_generation_tokens_total"),
         stats["tokens"]),
        ("prompt tokens", sums["prompt_tokens"], total(m, "mlx_lm_suffix_prompt_tokens_total"),
         None),
        ("drafts", None, total(m, spec + "drafts_total"), stats["models"][0]["draft_steps"]),
        ("drafts refused for cost", None, total(m, "mlx_lm_suffix_spec_decode_refused_drafts_total"),
         stats["models"][0]["refused"]),
        ("cached requests", None, total(m, "mlx_lm_suffix_cache_requests"),
         stats["cached_requests"]),
        ("cached tokens", None, total(m, "mlx_lm_suffix_cache_tokens"), stats["cached_tokens"]),
    ]
    print(f"\n{'counter':26} {'usage':>8} {'/metrics':>9} {'stats':>8}")
    same = True
    for name, usage, scraped, stat in rows:
        values = [v for v in (usage, scraped, stat) if v is not None]
        same &= len(set(values)) == 1
        cell = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731
        print(f"{name:26} {cell(usage):>8} {cell(scraped):>9} {cell(stat):>8}")
    print("\n" + "\n".join(line for line in text.splitlines()
                           if line.startswith((spec + "draft", spec + "accepted_tokens_total",
                                               spec + "drafts", "mlx_lm_suffix_requests_total",
                                               "mlx_lm_suffix_time_to_first_token_seconds_count"))))
    print(json.dumps({"same": same, "sums": sums}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
