"""The differential fuzzer (``mlx_lm_suffix.tools.fuzz``, issue 53): its
bounded profile. The longer run is ``mlx-lm-suffix soak --fuzz``
(docs/reliability.md)."""

import json
import subprocess
import sys

import mlx_lm  # noqa: F401  (first: mlx_lm_suffix imports mlx_lm)

EXAMPLES = 300


def test_fuzz_bounded_profile(tmp_path):
    """The bounded profile, run as the longer ones are: ``mlx-lm-suffix soak --fuzz``."""
    out = tmp_path / "fuzz.json"
    run = subprocess.run(
        [sys.executable, "-m", "mlx_lm_suffix", "soak", "--fuzz", "--examples", str(EXAMPLES),
         "--seed", "0", "--log-dir", str(tmp_path / "logs"), "--json-out", str(out)],
        capture_output=True, text=True, timeout=900)
    assert f"fuzz: {EXAMPLES} examples" in run.stdout, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["findings"] == []
    assert result["examples"] == EXAMPLES and result["shapes"] > EXAMPLES // 3
    assert result["outcomes"].get("stock ok / suffix ok", 0) > EXAMPLES // 4  # answers compared
    assert result["witness"] == {"sent": EXAMPLES, "harmed": []}
    assert result["suffix_restarts"] == 0 and result["generation_loop_failures"] == 0
    assert result["rss_growth_after_warmup_mb"] <= result["rss_growth_limit_mb"]
    assert result["ok"] and run.returncode == 0
