"""The stock ``mlx_lm.generate`` command with ``--suffix-draft``, in
subprocesses: from this environment and after a real ``pip install`` of the
package into a fresh virtual environment."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def fib(n):\\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\\n" * 3


def _run(python, *args, env=None):
    out = subprocess.run(
        [python, "-m", "mlx_lm", "generate", *args],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout, out.stderr


def _generate(python, model, *extra, env=None):
    stdout, _ = _run(python, "--model", str(model), "--prompt", PROMPT,
                     "--max-tokens", "48", "--ignore-chat-template", *extra, env=env)
    text = stdout.split("=" * 10)[1]
    return text, stdout


def test_help_lists_flags():
    stdout, _ = _run(sys.executable, "--help")
    for flag in ("--suffix-draft", "--num-draft-tokens", "--suffix-max-tree-depth",
                 "--suffix-max-cached-requests", "--suffix-max-spec-factor",
                 "--suffix-min-token-prob"):
        assert flag in stdout


def test_generate_cli_suffix_draft_matches_stock(tiny_model_path):
    stock, stock_out = _generate(sys.executable, tiny_model_path)
    ours, ours_out = _generate(sys.executable, tiny_model_path, "--suffix-draft")
    assert ours == stock and len(stock.strip()) > 0
    assert "Suffix decoding: drafted" in ours_out
    assert "Suffix decoding" not in stock_out
    # Bad knob: a clear argparse error, exit status 2.
    bad = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", "--model", str(tiny_model_path),
         "--suffix-draft", "--num-draft-tokens", "-3"],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 2 and "num_draft_tokens must be >= 0" in bad.stderr


def test_disable_env_var_keeps_stock_cli(tiny_model_path):
    env = dict(os.environ, MLX_LM_SUFFIX_AUTOLOAD="0")
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", "--model", str(tiny_model_path),
         "--suffix-draft"], capture_output=True, text=True, timeout=120, env=env,
    )
    assert out.returncode == 2 and "unrecognized arguments: --suffix-draft" in out.stderr


def test_fresh_venv_pip_install(tmp_path, tiny_model_path):
    """pip-install the package (wheel build, .pth startup file) into a new
    venv; its dependencies come from this environment through a path file,
    so the test needs no network."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # The new environment's own: no $PYTHONPATH (a source checkout on it
    # would shadow the installed package).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, env=env,
    ).stdout.strip()
    # Dependencies: this environment's site-packages, appended to sys.path
    # (its own .pth files, including our editable install, are not run).
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    build = subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", str(ROOT)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert build.returncode == 0, build.stderr
    assert (Path(site) / "mlx_lm_suffix.pth").exists()
    where = subprocess.run(
        [python, "-c", "import mlx_lm_suffix, mlx_lm; print(mlx_lm_suffix.__file__); "
         "print(hasattr(mlx_lm.stream_generate, '__wrapped__'))"],
        capture_output=True, text=True, check=True, cwd=tmp_path, env=env,
    ).stdout.split()
    assert where[0].startswith(site) and where[1] == "True"
    stock, _ = _generate(sys.executable, tiny_model_path)
    ours, out = _generate(python, tiny_model_path, "--suffix-draft", "--verbose", "True", env=env)
    assert ours == stock and "Suffix decoding: drafted" in out


def test_suffix_draft_with_a_draft_model(tiny_model_path):
    """``--suffix-draft --draft-model D``: the draft model drafts beside the
    trees (its counts in the verbose line), and the text is stock's."""
    stock, _ = _generate(sys.executable, tiny_model_path)
    ours, out = _generate(sys.executable, tiny_model_path, "--suffix-draft", "--draft-model",
                          str(tiny_model_path), "--suffix-policy", "fixed")
    assert ours == stock
    assert "draft model" in out and "Suffix decoding: drafted" in out
