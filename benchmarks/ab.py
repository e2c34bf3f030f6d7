"""Old code and new side by side: one command, run on an earlier commit and on
this checkout in turn, each run printing which package it imported.

    python benchmarks/ab.py OLD_COMMIT [--runs 2] [--out DIR] -- COMMAND...

(DIR: a folder outside the checkout; default ``$TMPDIR/mlx-lm-suffix-ab``.)

e.g. ``.venv/bin/python benchmarks/ab.py 3e2a235 -- python -m mlx_lm_suffix bench
--size tiny --workloads open-ended --arms stock,suffix-cold`` (``python``: this
interpreter; the command runs in each tree's folder). The old commit is checked
out in a ``git worktree`` (kept under DIR for later runs). The checkout's
``.venv`` imports ``mlx_lm_suffix`` at startup from the editable install (its
``.pth``), before a worktree's folder is on ``sys.path``, so the old runs get
``MLX_LM_SUFFIX_AUTOLOAD=0`` and ``PYTHONPATH=<worktree>`` (the package, once
imported, installs its hook; subprocesses such as the bench's servers inherit
both). Runs alternate old, new, new, old, ...; each one's output goes to
``DIR/{old,new}-{i}.log``, whose first line is the imported package's path.

Server runs: a pair with the same commit on both sides differed as much as
the changes compared (docs/benchmarks.md, "2026-12-06, midday"; whether the
worktree arm differs systematically is untraced): use more repetitions.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worktree(commit: str, out: Path) -> Path:
    """A worktree of ``commit`` under ``out`` (made once)."""
    sha = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    path = out / f"tree-{sha}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True)
    return path


def run(command: list, tree: Path, old: bool, log: Path) -> int:
    """``command`` in ``tree`` with the old code's environment where ``old``."""
    env = dict(os.environ)
    if old:
        env.update(MLX_LM_SUFFIX_AUTOLOAD="0", PYTHONPATH=str(tree))
    with log.open("w") as f:
        which = "import mlx_lm_suffix; print('code:', mlx_lm_suffix.__file__)"
        subprocess.run([sys.executable, "-c", which], cwd=tree, env=env, stdout=f, check=True)
        f.flush()
        return subprocess.run(command, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT).returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "mlx-lm-suffix-ab"))
    argv = sys.argv[1:]
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        ap.error("no command after --")
    cut = argv.index("--")
    args, command = ap.parse_args(argv[:cut]), argv[cut + 1 :]
    if command[0] == "python":  # (this interpreter: the checkout's venv)
        command[0] = sys.executable
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    trees = {"old": worktree(args.old, out), "new": ROOT}
    for i in range(1, args.runs + 1):
        for arm in ("old", "new") if i % 2 else ("new", "old"):
            log = out / f"{arm}-{i}.log"
            rc = run(command, trees[arm], arm == "old", log)
            print(f"{arm} run {i}: exit {rc}; {log.read_text().splitlines()[0]} -> {log}")


if __name__ == "__main__":
    main()
