"""Write the evaluation set's JSONL files (package data) from its sources.

    python benchmarks/build_evalset.py [--check]

Sources, in ``benchmarks/evalset/`` (all text written for this project):
``code-edit.json`` (per request: the file, its path and language in the
prompt, the kind of edit, the half, the instruction) with each file
``NAME.EXT`` and its edited version ``NAME.edited.EXT`` (the reference) in
``code-edit/``; ``agentic.json`` (sessions of tool calls and summaries);
``open-ended.md`` (questions and answers). Output:
``mlx_lm_suffix/data/evalset/<workload>.jsonl`` (see
:mod:`mlx_lm_suffix.tools.workloads`). ``--check`` writes nothing and
exits 1 if the files differ from what the sources give.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict

from mlx_lm_suffix.tools import workloads

SOURCE = Path(__file__).resolve().parent / "evalset"


def render() -> Dict[Path, str]:
    """Each output file's path and text."""
    built = workloads.build_eval_set(SOURCE)
    return {
        workloads.EVAL_SET_DIR / f"{name}.jsonl": "".join(json.dumps(r) + "\n" for r in records)
        for name, records in built.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    args = ap.parse_args()
    stale = False
    for path, text in render().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            status = "up to date"
        elif args.check:
            status, stale = "STALE", True
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            status = "written"
        print(f"{path.name}: {status}")
    if stale:
        sys.exit(1)


if __name__ == "__main__":
    main()
