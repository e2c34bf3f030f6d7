"""Benchmark workloads: built-in ones generated from text every machine has
(the Python standard library's own sources and docstrings), and a committed
evaluation set of original text.

Each workload is a JSONL file, one request per line::

    {"id": "code-edit-0", "workload": "code-edit", "session": "code-edit-0",
     "turn": 0, "messages": [{"role": "user", "content": "..."}],
     "reference": "the expected answer text"}

``"prompt"`` (raw text) may replace ``"messages"``. Requests of one
``"session"`` are sent in ``"turn"`` order (a multi-turn conversation whose
later prompts contain the earlier answers); different sessions are
independent. Ids are unique within a file. Other fields are kept and
ignored. Users can supply their own files in the same format.

Workloads:

- ``code-edit``: a real stdlib source file (truncated) plus an edit
  instruction; the answer is the edited file (most of it repeats the prompt).
- ``agentic``: multi-turn sessions whose answers are tool-call JSON and
  summaries that repeat structure across turns and sessions.
- ``open-ended``: a question about one module answered with the docstring of
  another, so answers share little with prompts or earlier answers.
- ``mixed`` (built-in only, not a default): agentic turns whose prompt holds
  a tool's output (lines of a source file) and whose answer copies some of
  its lines and writes new ones between them (comment lines of another
  module's docstring): repeats in places, new text in between.

Generation is deterministic: the same Python version gives the same files.

The evaluation set (:func:`eval_set`, package data under
``mlx_lm_suffix/data/evalset/``) has the same three kinds in the same
format, written for this project (none of it from ``_MODULES``, the text the
policy's constants were first chosen on); each record also has ``"half"``:
``"tune"`` (for choosing constants) or ``"report"`` (for figures), a whole
session in one half. Its code-edit records also say ``"language"`` and
``"edit"`` (the kind of edit). :func:`build_eval_set` makes it from the
sources in the repository's ``benchmarks/evalset/``.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sysconfig
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

__all__ = [
    "BUILTIN",
    "HALVES",
    "WORKLOADS",
    "agentic",
    "build_eval_set",
    "code_edit",
    "eval_set",
    "mixed",
    "open_ended",
    "read_workload",
    "write_eval_set",
    "write_workloads",
]

#: Workload names, in the order they are written and benchmarked (the
#: evaluation set has these).
WORKLOADS = ("code-edit", "agentic", "open-ended")
#: The built-in workloads: :data:`WORKLOADS` and ``mixed``.
BUILTIN = (*WORKLOADS, "mixed")
#: Halves of the evaluation set: constants are chosen on "tune", figures
#: reported on "report".
HALVES = ("tune", "report")

# Small, stable, pure-Python stdlib modules (present on every CPython).
_MODULES = (
    "textwrap",
    "shlex",
    "fnmatch",
    "glob",
    "bisect",
    "colorsys",
    "queue",
    "sched",
    "heapq",
    "calendar",
    "string",
    "netrc",
    "graphlib",
    "numbers",
    "copy",
    "keyword",
    "operator",
    "pprint",
    "difflib",
    "zipapp",
    "tabnanny",
    "uu",
    "wave",
    "filecmp",
)


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"] or os.path.dirname(os.__file__))


def _sources() -> List[tuple]:
    """(module name, source text) for each available module of ``_MODULES``."""
    out = []
    for name in _MODULES:
        path = _stdlib_dir() / f"{name}.py"
        try:
            out.append((name, path.read_text(encoding="utf-8")))
        except OSError:
            continue
    if not out:
        raise RuntimeError(f"no standard library sources found under {_stdlib_dir()}")
    return out


def _truncate(text: str, max_chars: int) -> str:
    """``text`` cut at a line boundary to at most ``max_chars`` characters."""
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n", 0, max_chars)
    return text[: cut + 1 if cut > 0 else max_chars]


def _functions(source: str) -> List[str]:
    return re.findall(r"^def ([A-Za-z_][A-Za-z0-9_]*)\(", source, flags=re.M)


def _docstring(source: str) -> Optional[str]:
    try:
        return ast.get_docstring(ast.parse(source))
    except SyntaxError:
        return None


def _user(text: str) -> Dict[str, str]:
    return {"role": "user", "content": text}


def code_edit_message(path: str, language: str, source: str, task: str) -> Dict[str, str]:
    """The user message of a code-edit request: the file in a fenced block
    (four backticks where the file holds three), then the task."""
    fence = "````" if "```" in source else "```"
    return _user(f"File `{path}`:\n{fence}{language}\n{source}{fence}\n\n{task}")


def session_records(
    workload: str,
    session: str,
    messages: List[Dict[str, str]],
    answers: Sequence[str],
    results: Sequence[str],
    **fields: Any,
) -> List[Dict[str, Any]]:
    """The records of one multi-turn session: turn ``t`` is sent ``messages``
    followed, for each earlier turn, by its answer (as the assistant) and
    its tool result (as the user, after a line ``Tool result:``), and its
    reference is ``answers[t]``. ``results[t]`` follows answer ``t`` (none
    after the last answers if ``results`` is shorter). ``fields`` are added
    to every record."""
    records = []
    messages = [dict(m) for m in messages]
    for t, answer in enumerate(answers):
        records.append(
            {
                "id": f"{session}-{t}",
                "workload": workload,
                "session": session,
                "turn": t,
                **fields,
                "messages": [dict(m) for m in messages],
                "reference": answer,
            }
        )
        messages.append({"role": "assistant", "content": answer})
        if t < len(results):
            messages.append(_user(f"Tool result:\n{results[t]}"))
    return records


def code_edit(n: int = 8, max_chars: int = 4000) -> List[Dict[str, Any]]:
    """Code-edit requests: a source file plus an edit (rename a function
    everywhere, or add a line after each ``def`` header); the reference is the
    whole edited file."""
    records = []
    sources = [(m, _truncate(s, max_chars)) for m, s in _sources()]
    for i in range(n):
        module, src = sources[i % len(sources)]
        funcs = _functions(src)
        if i % 2 == 0 and funcs:
            old = max(funcs, key=lambda f: (src.count(f), f))
            new = f"{old}_v2"
            task = (
                f"Rename the function `{old}` to `{new}` everywhere in `Lib/{module}.py`. "
                "Reply with the complete updated file only."
            )
            edited = re.sub(rf"\b{re.escape(old)}\b", new, src)
        else:
            task = (
                "Add the comment line `# TODO: review` (indented like the body) "
                "right after every function definition line of "
                f"`Lib/{module}.py`. Reply with the complete updated file only."
            )
            edited = re.sub(
                r"^(\s*)(def [^\n]*:\n)",
                lambda m: f"{m.group(1)}{m.group(2)}{m.group(1)}    # TODO: review\n",
                src,
                flags=re.M,
            )
        records.append(
            {
                "id": f"code-edit-{i}",
                "workload": "code-edit",
                "session": f"code-edit-{i}",
                "turn": 0,
                "messages": [code_edit_message(f"Lib/{module}.py", "python", src, task)],
                "reference": edited,
            }
        )
    return records


def agentic(n: int = 8, turns: int = 3) -> List[Dict[str, Any]]:
    """Agentic sessions of ``turns`` turns (``n`` requests in all): the agent
    greps for a function, reads its lines, and summarises; answers are
    tool-call JSON and summaries with the same structure every time."""
    system = {
        "role": "system",
        "content": "You are a coding agent. Call tools with one JSON object per "
        'reply: {"tool": name, "arguments": {...}}. Tools: grep(pattern, path), '
        "read_file(path, start, end). When done, reply with a summary.",
    }
    records: List[Dict[str, Any]] = []
    candidates = [(m, s, f) for m, s in _sources() for f in _functions(s)[:2]]
    session = 0
    while len(records) < n:
        module, src, func = candidates[session % len(candidates)]
        lines = src.splitlines()
        start = next(i for i, ln in enumerate(lines) if ln.startswith(f"def {func}("))
        end = min(len(lines), start + 12)
        path = f"Lib/{module}.py"
        messages = [system, _user(f"Where is `{func}` defined in {path}, and what does it do?")]
        answers = [
            json.dumps({"tool": "grep", "arguments": {"pattern": f"def {func}(", "path": path}}),
            json.dumps(
                {"tool": "read_file", "arguments": {"path": path, "start": start + 1, "end": end}}
            ),
        ]
        doc = (_docstring(src) or "").strip().splitlines()
        first_doc = doc[0] if doc else f"the {module} module"
        answers.append(
            f"Summary:\n- Function: `{func}`\n- File: `{path}`\n"
            f"- Lines: {start + 1}-{end}\n- Module: {first_doc}\n"
            f"- Signature: `{lines[start].rstrip(':')}`\n- Status: done"
        )
        results = [
            f"{path}:{start + 1}:{lines[start]}",
            "\n".join(f"{k + 1}: {lines[k]}" for k in range(start, end)),
        ]
        keep = min(turns, n - len(records))
        records += session_records("agentic", f"agentic-{session}", messages, answers[:keep], results)
        session += 1
    return records


def open_ended(n: int = 8, max_chars: int = 1500) -> List[Dict[str, Any]]:
    """Open-ended requests: a question about one module whose reference is
    the docstring of another, unrelated module."""
    docs = [(m, d) for m, s in _sources() if (d := _docstring(s))]
    half = max(1, len(docs) // 2)
    records = []
    for i in range(n):
        asked = docs[i % len(docs)][0]
        _, answer = docs[(i + half) % len(docs)]
        records.append(
            {
                "id": f"open-ended-{i}",
                "workload": "open-ended",
                "session": f"open-ended-{i}",
                "turn": 0,
                "messages": [_user(f"In a few paragraphs, what is the `{asked}` module for?")],
                "reference": _truncate(answer, max_chars),
            }
        )
    return records


def mixed(n: int = 8, turns: int = 2, max_lines: int = 40) -> List[Dict[str, Any]]:
    """Agentic sessions of ``turns`` turns (``n`` requests in all) that
    annotate source files: each prompt (and each later tool result) holds
    up to ``max_lines`` lines of a module read by a tool, and its answer
    copies them in runs of 2 to 5 lines with 1 to 3 new comment lines
    between runs (sentences of another module's docstring, which the prompt
    does not hold)."""
    system = {
        "role": "system",
        "content": "You are a coding agent. Files come back from read_file(path, start, end). "
        "Reply with the lines you were asked about, annotated with comments.",
    }
    sources = _sources()
    prose = [
        s.strip()
        for _, src in sources
        for s in re.split(r"(?<=[.!?])\s+", " ".join((_docstring(src) or "").split()))
        if len(s.strip()) > 20
    ]
    records: List[Dict[str, Any]] = []
    session, said = 0, 0
    while len(records) < n:
        keep = min(turns, n - len(records))
        chunks, answers = [], []
        for t in range(keep):
            module, src = sources[(session * turns + t) % len(sources)]
            lines = [ln for ln in src.splitlines() if ln.strip()]
            start = (7 * session + 13 * t) % max(1, len(lines) - max_lines)
            chunk = lines[start : start + max_lines]
            chunks.append((f"Lib/{module}.py", start + 1, chunk))
            out, i, k = [], 0, session + t
            while i < len(chunk):
                run = 2 + k % 4
                out += chunk[i : i + run]
                i += run
                for _ in range(1 + k % 3):
                    out.append(f"# {prose[said % len(prose)]}")
                    said += 1
                k += 1
            answers.append("\n".join(out))

        def shown(path: str, first: int, chunk: List[str]) -> str:
            return f"{path} lines {first}-{first + len(chunk) - 1}:\n" + "\n".join(chunk)

        path, first, chunk = chunks[0]
        messages = [system, _user(
            f"Read `{path}` and annotate what it does: repeat the lines, with comment lines "
            f"between them.\n\nTool result:\n{shown(path, first, chunk)}")]
        results = [shown(*c) + "\n\nAnnotate these lines the same way." for c in chunks[1:]]
        records += session_records("mixed", f"mixed-{session}", messages, answers, results)
        session += 1
    return records


def build(name: str, n: int = 8, max_chars: int = 4000) -> List[Dict[str, Any]]:
    """The records of workload ``name`` (one of :data:`BUILTIN`)."""
    if name == "code-edit":
        return code_edit(n, max_chars)
    if name == "agentic":
        return agentic(n)
    if name == "open-ended":
        return open_ended(n, max(200, max_chars // 2))
    if name == "mixed":
        return mixed(n, max_lines=max(8, max_chars // 100))
    raise ValueError(f"unknown workload {name!r}; expected one of {BUILTIN}")


#: Where the evaluation set's JSONL files are (package data).
EVAL_SET_DIR = Path(__file__).resolve().parent.parent / "data" / "evalset"


def _check_half(half: str) -> None:
    if half not in (*HALVES, "all"):
        raise ValueError(f"unknown half {half!r}; expected one of {HALVES} or 'all'")


def eval_set(name: str, half: str = "report") -> List[Dict[str, Any]]:
    """The evaluation set's records of workload ``name`` (one of
    :data:`WORKLOADS`) in ``half`` (one of :data:`HALVES`, or ``"all"``),
    in session and turn order."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")
    _check_half(half)
    records = read_workload(EVAL_SET_DIR / f"{name}.jsonl")
    return [r for r in records if half == "all" or r["half"] == half]


def write_eval_set(
    directory: str | os.PathLike, names: Optional[Sequence[str]] = None, half: str = "report"
) -> Dict[str, Path]:
    """Write the evaluation set's records of ``half`` as
    ``<directory>/<name>.jsonl`` for each workload of ``names`` (default:
    all); returns name -> path."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in names or WORKLOADS:
        records = eval_set(name, half)
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return paths


def _eval_code_edit(source: Path) -> List[Dict[str, Any]]:
    """Code-edit records from ``code-edit.json`` (file, path, language,
    edit, half, instruction per request) and the files it names: the
    reference of ``NAME.EXT`` is ``NAME.edited.EXT``."""
    records = []
    for entry in json.loads((source / "code-edit.json").read_text(encoding="utf-8")):
        stem, ext = os.path.splitext(entry["file"])
        before = (source / "code-edit" / entry["file"]).read_text(encoding="utf-8")
        after = (source / "code-edit" / f"{stem}.edited{ext}").read_text(encoding="utf-8")
        task = f"{entry['instruction']} Reply with the complete updated file only."
        rid = f"code-edit-{stem.lower()}"
        records.append(
            {
                "id": rid,
                "workload": "code-edit",
                "session": rid,
                "turn": 0,
                "half": entry["half"],
                "language": entry["language"],
                "edit": entry["edit"],
                "messages": [code_edit_message(entry["path"], entry["language"], before, task)],
                "reference": after,
            }
        )
    return records


def _eval_agentic(source: Path) -> List[Dict[str, Any]]:
    """Agentic records from ``agentic.json``: per session a system prompt,
    the user's task and turns, each a tool ``call`` (answered as its JSON)
    with its ``result`` (text, or JSON), or a final plain-text ``answer``."""
    records = []
    for s in json.loads((source / "agentic.json").read_text(encoding="utf-8")):
        answers, results = [], []
        for turn in s["turns"]:
            if "call" in turn:
                answers.append(json.dumps(turn["call"]))
                r = turn["result"]
                results.append(r if isinstance(r, str) else json.dumps(r))
            else:
                answers.append(turn["answer"])
        messages = [{"role": "system", "content": s["system"]}, _user(s["user"])]
        records += session_records(
            "agentic", f"agentic-{s['id']}", messages, answers, results, half=s["half"]
        )
    return records


def _eval_open_ended(source: Path) -> List[Dict[str, Any]]:
    """Open-ended records from ``open-ended.md``: sections ``## ID (HALF)``,
    each a ``> question`` line and the answer (paragraphs unwrapped)."""
    text = (source / "open-ended.md").read_text(encoding="utf-8")
    records = []
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        head, body = section.split("\n", 1)
        m = re.fullmatch(r"([a-z0-9-]+) \((\w+)\)", head.strip())
        question, answer = body.strip().split("\n", 1)
        if not m or not question.startswith("> "):
            raise ValueError(f"open-ended.md: malformed section {head!r}")
        paragraphs = [" ".join(p.split()) for p in answer.strip().split("\n\n")]
        rid = f"open-ended-{m[1]}"
        records.append(
            {
                "id": rid,
                "workload": "open-ended",
                "session": rid,
                "turn": 0,
                "half": m[2],
                "messages": [_user(question[2:].strip())],
                "reference": "\n\n".join(paragraphs),
            }
        )
    return records


def build_eval_set(source: str | os.PathLike) -> Dict[str, List[Dict[str, Any]]]:
    """The evaluation set's records by workload, made from the sources in
    ``source`` (the repository's ``benchmarks/evalset/``); ``ValueError``
    on a record without a valid half."""
    source = Path(source)
    built = {
        "code-edit": _eval_code_edit(source),
        "agentic": _eval_agentic(source),
        "open-ended": _eval_open_ended(source),
    }
    for records in built.values():
        for r in records:
            if r["half"] not in HALVES:
                raise ValueError(f"{r['id']}: half {r['half']!r} is not one of {HALVES}")
    return built


def write_workloads(
    directory: str | os.PathLike,
    n: int = 8,
    max_chars: int = 4000,
    names: Optional[List[str]] = None,
) -> Dict[str, Path]:
    """Write each workload as ``<directory>/<name>.jsonl``; returns name -> path.

    ``n`` is the number of requests per workload, ``max_chars`` the length of
    the source files in code-edit prompts (about 3-4 characters a token).
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in names or WORKLOADS:
        path = out / f"{name}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for record in build(name, n, max_chars):
                f.write(json.dumps(record) + "\n")
        paths[name] = path
    return paths


def read_jsonl(path: str | os.PathLike) -> Iterator[Tuple[int, Any]]:
    """``(line number, value)`` for each non-blank line of a JSONL file;
    ``ValueError`` naming the file and line on invalid JSON."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e


def read_workload(path: str | os.PathLike) -> List[Dict[str, Any]]:
    """Read and validate a workload JSONL; records are returned sorted by
    (session order of first appearance, turn). Missing ``id``/``session``/
    ``turn``/``workload`` fields get defaults (each record its own session);
    ``ValueError`` on a repeated id."""
    path = Path(path)
    records = []
    ids = set()
    for lineno, r in read_jsonl(path):
        if not isinstance(r, dict) or ("messages" in r) == ("prompt" in r):
            raise ValueError(f"{path}:{lineno}: need exactly one of 'messages' or 'prompt'")
        if not isinstance(r.get("reference"), str):
            raise ValueError(f"{path}:{lineno}: 'reference' must be a string")
        r.setdefault("id", f"{path.stem}-{lineno}")
        if r["id"] in ids:
            raise ValueError(f"{path}:{lineno}: id {r['id']!r} repeats an earlier request's")
        ids.add(r["id"])
        r.setdefault("workload", path.stem)
        r.setdefault("session", r["id"])
        r.setdefault("turn", 0)
        records.append(r)
    first = {}
    for i, r in enumerate(records):
        first.setdefault(r["session"], i)
    records.sort(key=lambda r: (first[r["session"]], r["turn"]))
    return records
