"""The differential fuzzer (``mlx_lm_suffix.tools.fuzz``, issue 53): its
bounded profile, and a test for each of its findings, each failing on the
code before its fix. The longer run is ``mlx-lm-suffix soak --fuzz``
(docs/reliability.md)."""

import json
import subprocess
import sys
from pathlib import Path

import mlx_lm  # noqa: F401  (first: mlx_lm_suffix imports mlx_lm)
import pytest

from mlx_lm_suffix.tools.fuzz import CHAT, TEXT, json_case, send

sys.path.insert(0, str(Path(__file__).parent))
from test_server import Server  # noqa: E402

EXAMPLES = 300


@pytest.mark.parametrize("paired", [False, True])
def test_fuzz_bounded_profile(tmp_path, tiny_model_path, paired):
    """The bounded profile, run as the longer ones are: ``mlx-lm-suffix soak
    --fuzz``; and with the suffix server paired with a draft model (the
    target itself, the fixed policy: it drafts wherever the trees do not,
    and its drafts hold), half as many examples. The paired server's memory
    is not checked here: it grows for longer than the first fifth of so
    short a run as it reaches its working set (a run of 150 examples went
    from 135 to 239 MB after its warm-up; the 2,000-example runs grew 21
    and 56 MB after theirs, docs/reliability.md)."""
    out, examples = tmp_path / "fuzz.json", EXAMPLES // 2 if paired else EXAMPLES
    draft = ["--draft-model", str(tiny_model_path), "--policy", "fixed"] if paired else []
    run = subprocess.run(
        [sys.executable, "-m", "mlx_lm_suffix", "soak", "--fuzz", "--examples", str(examples),
         "--model", str(tiny_model_path), *draft,
         "--seed", "0", "--log-dir", str(tmp_path / "logs"), "--json-out", str(out)],
        capture_output=True, text=True, timeout=900)
    assert f"fuzz: {examples} examples" in run.stdout, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["findings"] == []
    assert (result["source_accepted"].get("model", 0) > 0) == paired
    assert result["examples"] == examples and result["shapes"] > examples // 3
    assert result["outcomes"].get("stock ok / suffix ok", 0) > examples // 4  # answers compared
    assert result["witness"] == {"sent": examples, "harmed": []}
    assert result["suffix_restarts"] == 0 and result["generation_loop_failures"] == 0
    if not paired:
        assert result["rss_growth_after_warmup_mb"] <= result["rss_growth_limit_mb"]
        assert result["ok"] and run.returncode == 0


@pytest.fixture(scope="module")
def servers(tiny_model_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz-findings")
    stock = Server(tiny_model_path, "--max-tokens", "16", log_dir=logs, name="stock",
                   env={"MLX_LM_SUFFIX_AUTOLOAD": "0"})
    suffix = Server(tiny_model_path, "--max-tokens", "16", "--draft", "suffix", log_dir=logs,
                    name="suffix")
    yield stock, suffix
    stock.stop()
    suffix.stop()


# Findings: requests stock answers 200 and a suffix server refused (400).
SERVED = {
    # Stock reads `stop` as `body.get("stop") or []`, a string as one word,
    # anything else iterated: an object's keys are stop words, false and 0 none.
    "stop an object": (CHAT, {"stop": {"e": 1}}),
    "stop false": (TEXT, {"stop": False}),
    "stop 0": (CHAT, {"stop": 0}),
    "stop {}": (TEXT, {"stop": {}}),
}


@pytest.mark.parametrize("case", list(SERVED))
def test_finding_served_as_stock(case, servers):
    path, fields = SERVED[case]
    main = {"prompt": "Repeat: one two three"} if path == TEXT else {
        "messages": [{"role": "user", "content": "Repeat: one two three"}]}
    request = json_case({**main, **fields, "max_tokens": 12}, path)
    stock, suffix = (send(s.port, request) for s in servers)
    assert stock.kind == "ok", stock
    assert (suffix.kind, suffix.text, suffix.finish) == ("ok", stock.text, stock.finish), suffix
