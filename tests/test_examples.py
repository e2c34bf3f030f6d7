"""The examples in examples/ run end to end (as subprocesses, on the tiny
model, with few tokens) and print what their docs promise."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, timeout: float = 240) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def number(label: str, text: str) -> float:
    m = re.search(rf"^{label}:\s*([0-9.]+)(%?)", text, re.M)
    assert m, f"no {label!r} line in:\n{text}"
    return float(m[1]) / (100 if m[2] else 1)


@functools.lru_cache(maxsize=1)
def server_has_suffix_draft() -> bool:
    """Whether ``mlx_lm.server`` accepts ``--draft suffix`` (the server side
    of the plugin may not be installed)."""
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm.server", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return re.search(r"--draft\b(?!-)", out) is not None


def test_examples_have_header_and_command() -> None:
    for name in ("stream_generate.py", "agent_client.py", "tune_from_log.py"):
        doc = (EXAMPLES / name).read_text().split('"""')[1]
        assert f"python examples/{name}" in doc, name
    assert (EXAMPLES / "sample_log.jsonl").stat().st_size < 100_000


def test_stream_generate(tiny_model_path: Path) -> None:
    out = run_example(
        "stream_generate.py", "--model", tiny_model_path, "--max-tokens", 40, "--turns", 3,
        "--suffix-policy", "fixed",  # drafts whatever repeats, whatever the load
    )
    assert "texts match: yes" in out
    drafted = number("drafted tokens", out)
    accepted = number("accepted tokens", out)
    assert 0 < accepted <= drafted  # later turns repeat earlier answers
    assert number("acceptance rate", out) == pytest.approx(accepted / drafted, abs=1e-3)
    assert 1.0 <= number("tokens per step", out) <= 1 + 8  # --num-draft-tokens 8


def test_tune_from_log(tiny_model_path: Path) -> None:
    out = run_example("tune_from_log.py", "--model", tiny_model_path, "--max-records", 6)
    command = out.strip().splitlines()[-1]
    assert command.startswith("mlx_lm.server ")
    assert "--draft suffix" in command
    assert f"--model {tiny_model_path}" in command
    assert "--num-draft-tokens" in command
    assert re.search(r"best [0-9.]+x estimated speedup", out)


def test_tune_from_log_default_sample() -> None:
    out = run_example("tune_from_log.py", "--max-records", 4)
    command = out.strip().splitlines()[-1]
    assert command.startswith("mlx_lm.server --draft suffix")


def test_agent_client(tiny_model_path: Path) -> None:
    pytest.importorskip("openai")
    if not server_has_suffix_draft():
        pytest.skip("mlx_lm.server does not accept --draft suffix (server side not installed)")
    out = run_example(
        "agent_client.py", "--model", tiny_model_path, "--turns", 3, "--max-tokens", 30,
        # Whether a draft pays on the tiny model depends on this machine's
        # load; fixed-length drafting always drafts what repeats.
        "--suffix-policy", "fixed",
    )
    usages = re.findall(r"^usage: (.*)$", out, re.M)
    assert len(usages) == 3, out
    fields = [dict(kv.split("=") for kv in u.split()) for u in usages]
    for f in fields:
        assert 0 <= int(f["accepted_draft_tokens"]) <= int(f["draft_tokens"])
    # The history repeats across turns: the later turns draft something.
    assert sum(int(f["draft_tokens"]) for f in fields[1:]) > 0
