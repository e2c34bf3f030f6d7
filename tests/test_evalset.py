"""The evaluation set (package data): up to date with its sources in
benchmarks/evalset/, and as broad as its contract says."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from mlx_lm_suffix.tools import workloads

SOURCE = Path(__file__).resolve().parent.parent / "benchmarks" / "evalset"


@pytest.fixture(scope="module")
def built():
    return workloads.build_eval_set(SOURCE)


def test_package_data_is_built_from_the_sources(built):
    # Run `python benchmarks/build_evalset.py` after editing the sources.
    for name in workloads.WORKLOADS:
        lines = (workloads.EVAL_SET_DIR / f"{name}.jsonl").read_text().splitlines()
        assert [json.loads(x) for x in lines] == built[name], name
        assert workloads.eval_set(name, "all") == built[name]


def test_every_workload_has_24_requests_split_into_halves():
    for name in workloads.WORKLOADS:
        records = workloads.eval_set(name, "all")
        halves = Counter(r["half"] for r in records)
        assert len(records) >= 24 and set(halves) == set(workloads.HALVES), name
        assert min(halves.values()) >= 12, (name, halves)
        assert len({r["id"] for r in records}) == len(records)
        # A session lies in one half.
        assert all(len({r["half"] for r in records if r["session"] == s}) == 1 for s in {r["session"] for r in records})
        tune, report = (workloads.eval_set(name, h) for h in workloads.HALVES)
        assert {r["id"] for r in tune}.isdisjoint(r["id"] for r in report)
        assert len(tune) + len(report) == len(records)
    with pytest.raises(ValueError):
        workloads.eval_set("code-edit", "both")
    with pytest.raises(ValueError):
        workloads.eval_set("chat")


def test_code_edits_span_languages_and_kinds_of_edit():
    records = workloads.eval_set("code-edit", "all")
    languages = Counter(r["language"] for r in records)
    edits = Counter(r["edit"] for r in records)
    assert len(languages) >= 12 and len(edits) >= 10
    for kind, n in edits.items():  # every kind used twice or more is in both halves
        if n > 1:
            assert {r["half"] for r in records if r["edit"] == kind} == set(workloads.HALVES), kind
    for r in records:
        prompt = r["messages"][0]["content"]
        source = re.search(r"^(`{3,4})\w+\n(.*)^\1\n\n", prompt, flags=re.M | re.S)[2]
        assert 1000 <= len(source) <= 3000, r["id"]
        assert r["reference"] != source and r["reference"].endswith("\n")
        assert prompt.endswith("Reply with the complete updated file only.")


def test_no_text_of_the_builtin_workloads():
    # The policy's constants were chosen on the stdlib modules of the
    # built-in workloads: none of their lines may be in the set.
    text = "\n".join(
        m["content"] + r["reference"]
        for name in workloads.WORKLOADS
        for r in workloads.eval_set(name, "all")
        for m in r["messages"]
    )
    lines = {ln.strip() for _, src in workloads._sources() for ln in src.splitlines()}
    assert not [ln for ln in lines if len(ln) > 40 and ln in text]


def test_agentic_sessions_carry_their_answers_and_new_schemas():
    records = workloads.eval_set("agentic", "all")
    sessions = {}
    for r in records:
        sessions.setdefault(r["session"], []).append(r)
    assert len(sessions) >= 8
    schemas = set()
    for turns in sessions.values():
        assert [r["turn"] for r in turns] == list(range(len(turns))) and len(turns) >= 3
        for earlier, later in zip(turns, turns[1:]):
            assert later["messages"][: len(earlier["messages"])] == earlier["messages"]
            assert later["messages"][len(earlier["messages"])] == {
                "role": "assistant", "content": earlier["reference"]
            }
        calls = [json.loads(r["reference"]) for r in turns[:-1]]
        schemas |= {tuple(sorted(c)) for c in calls}
        assert not turns[-1]["reference"].startswith("{")  # a summary ends the session
    # Other schemas than the built-in generator's {"tool", "arguments"}.
    assert len(schemas) >= 4 and ("arguments", "tool") not in schemas


def test_open_ended_answers_share_little_with_prompts_or_each_other():
    records = workloads.eval_set("open-ended", "all")

    def grams(text):
        words = re.findall(r"[a-z']+", text.lower())
        return {tuple(words[i : i + 4]) for i in range(len(words) - 3)}

    answers = [grams(r["reference"]) for r in records]
    for i, r in enumerate(records):
        others = set().union(*(g for j, g in enumerate(answers) if j != i))
        shared = answers[i] & (others | grams(r["messages"][0]["content"]))
        assert len(shared) <= 0.05 * len(answers[i]), (r["id"], sorted(shared)[:5])
        assert "\n\n" in r["reference"] and "\n" not in r["reference"].replace("\n\n", "")


def test_write_eval_set_writes_one_half(tmp_path):
    paths = workloads.write_eval_set(tmp_path, ["open-ended", "agentic"], half="tune")
    assert list(paths) == ["open-ended", "agentic"]
    for name, path in paths.items():
        assert workloads.read_workload(path) == workloads.eval_set(name, "tune")


def test_repeated_ids_are_refused(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"id": "a", "prompt": "x", "reference": "y"}\n' * 2)
    with pytest.raises(ValueError, match="repeats"):
        workloads.read_workload(path)
