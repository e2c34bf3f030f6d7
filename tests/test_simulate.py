"""Offline replay (mlx_lm_suffix.tools.simulate) and the `simulate` CLI."""

import json

import pytest
from click.testing import CliRunner

from mlx_lm_suffix.drafter import DEFAULT_MAX_TREE_DEPTH, SuffixDrafter
from mlx_lm_suffix.policy import VerifyCost
from mlx_lm_suffix.policy.calibration import RequestTrust
from mlx_lm_suffix.tools.cli import main
from mlx_lm_suffix.tools.simulate import (
    DEFAULT_STEP_SECONDS,
    Record,
    cost_from_times,
    default_cost,
    expand_grid,
    load_encoder,
    read_records,
    recommend,
    replay,
    server_command,
    simulate,
    tokenize_records,
)

# Ten distinct tokens, none of them in any prompt below.
RESPONSE = list(range(100, 110))
CORPUS = [
    Record(list(range(10, 20)), RESPONSE),  # nothing to draft from yet
    Record(list(range(30, 40)), RESPONSE),  # repeats the first response
    Record([1, 2], [500, 501, 502]),  # shares nothing with anything
]
KNOBS = {"num_draft_tokens": 8, "max_spec_factor": 1.0, "max_spec_offset": 0.0, "policy": "fixed"}


def test_replay_hand_counted():
    """Per record, as the loop steps it (pipelined plain steps whose forward
    checks the draft's first token; settled after a verification), with
    factor 1 a draft is as long as the match (the tokens of the response
    committed so far), capped by what may still be emitted:

    record 1: 10 plain steps, nothing drafted.
    record 2: plain 100 (its draft [101]: one token, which the plain forward
              would only check) | plain 101, draft [102, 103] confirmed by
              the forward's 102 and verified (2 tokens fed) -> 102, 103 |
              settled: 104 and the draft min(5, 10 - 4 - 1) = [105..109]
              verified in one forward of 6 tokens -> 104..109.
              4 forwards, 7 drafted and accepted, cost 1 + 1 + 1.04 + 1.2.
    record 3: 3 plain steps, nothing drafted.
    """
    drafter = SuffixDrafter(**KNOBS)
    expected = [(10, 0, 10.0), (4, 7, 4.24), (3, 0, 3.0)]
    for record, (steps, drafted, cost) in zip(CORPUS, expected, strict=True):
        before = drafter.stats.as_dict()
        total, _ = replay(drafter, record)
        after = drafter.stats.as_dict()
        assert after["steps"] - before["steps"] == steps
        assert after["drafted"] - before["drafted"] == drafted
        assert after["accepted"] - before["accepted"] == drafted
        assert after["tokens"] - before["tokens"] == len(record.response)
        assert total == pytest.approx(cost)
    assert drafter.active_requests == 0
    assert drafter.cached_requests == 3


def test_simulate_totals():
    (res,) = simulate(CORPUS, KNOBS)
    assert res["records"] == 3
    assert res["tokens"] == 23
    assert res["steps"] == 17
    assert res["drafted"] == res["accepted"] == 7
    assert res["acceptance_rate"] == 1.0
    assert res["accepted_per_step"] == pytest.approx(7 / 17)
    assert res["tokens_per_step"] == pytest.approx(23 / 17)
    assert res["est_speedup"] == pytest.approx(23 / 17.24)
    assert res["draft_us_per_token"] > 0
    assert res["num_draft_tokens"] == 8 and res["max_tree_depth"] == DEFAULT_MAX_TREE_DEPTH
    assert res["policy"] == "fixed"


def test_unrelated_response_drafts_nothing():
    (res,) = simulate([CORPUS[2]], KNOBS)
    assert res["drafted"] == res["accepted"] == 0
    assert res["steps"] == res["tokens"] == 3
    assert res["acceptance_rate"] == 0.0
    assert res["est_speedup"] == 1.0


def test_warm_fills_cache_first():
    """Warm: record 1 drafts from its own (cached) response like record 2
    (4 forwards, 7 drafted); record 3's drafts are one token, which a plain
    forward would only check: 4 + 4 + 3 steps."""
    (res,) = simulate(CORPUS, KNOBS, warm=True)
    assert res["steps"] == 11
    assert res["drafted"] == res["accepted"] == 7 + 7
    assert res["tokens"] == 23


def test_rejected_drafts_count():
    """A prompt tree predicting the wrong continuation: drafted, not accepted."""
    (res,) = simulate([Record([5, 6, 7, 8, 5, 6, 7, 8], [5, 9, 9, 9])], KNOBS)
    assert res["drafted"] > 0
    assert res["accepted"] < res["drafted"]
    assert res["tokens"] == 4


def test_user_scopes_are_separate():
    recs = [Record(CORPUS[0].prompt, RESPONSE, "a"), Record(CORPUS[1].prompt, RESPONSE, "b")]
    (res,) = simulate(recs, KNOBS)
    assert res["drafted"] == 0
    recs[1] = recs[1]._replace(user="a")
    assert simulate(recs, KNOBS)[0]["drafted"] == 7


def test_grid_expansion():
    points = expand_grid(
        {"num_draft_tokens": [4, 8], "min_token_prob": [0.05, 0.1], "max_tree_depth": 24}
    )
    assert len(points) == 4
    assert {"num_draft_tokens": 8, "min_token_prob": 0.05, "max_tree_depth": 24} in points
    assert expand_grid([{"num_draft_tokens": 4}]) == [{"num_draft_tokens": 4}]
    with pytest.raises(ValueError, match="unknown knobs"):
        expand_grid({"draft_tokens": [4]})
    assert len(simulate(CORPUS, {"num_draft_tokens": [4, 8], "max_spec_factor": [1, 2]})) == 4


def test_costs():
    assert default_cost(0) == 1.0
    assert default_cost(10) == pytest.approx(1.4)
    cost = cost_from_times({"1": 100, "2": 100, "5": 130, "9": 170})
    assert cost(0) == 1.0
    assert cost(1) == 1.0
    assert cost(2) == pytest.approx(1.1)  # 3 tokens: between widths 2 and 5
    assert cost(8) == pytest.approx(1.7)
    assert cost(12) == pytest.approx(2.1)  # extrapolated with the last slope
    with pytest.raises(ValueError):
        cost_from_times({"2": 100})
    # Free verification: the estimate equals tokens per step.
    (res,) = simulate(CORPUS, KNOBS, cost=cost_from_times({1: 1.0}))
    assert res["est_speedup"] == pytest.approx(res["tokens_per_step"])


def test_adaptive_policy_is_replayed():
    """By default the replay cuts drafts as the server would: prompts whose
    repeats predict the wrong continuation (past a first token the plain
    forward confirms) stop being verified once the policy has learnt so
    (where verification is dear), while repeated responses are drafted as
    at fixed length."""
    wrong = [Record([5, 6, 7, 8] * 4, [5, 6, 1000 + 3 * k, 1001 + 3 * k]) for k in range(20)]
    dear = cost_from_times({1: 1.0, 2: 1.5, 4: 2.5, 8: 4.5, 16: 8.5})
    fixed, adaptive = simulate(wrong, [KNOBS, {**KNOBS, "policy": "adaptive"}], cost=dear)
    # Fixed: every record verifies [6, 7, 8], of which only 6 (confirmed
    # by the plain forward) holds.
    assert fixed["drafted"] == 60 and fixed["accepted"] == 20
    assert 0 < adaptive["drafted"] < 30 and adaptive["policy"] == "adaptive"
    assert adaptive["est_speedup"] > fixed["est_speedup"]
    (res,) = simulate(CORPUS, {k: v for k, v in KNOBS.items() if k != "policy"})
    assert res["policy"] == "adaptive" and res["drafted"] == res["accepted"] == 7


def test_replay_waits_after_each_read():
    """Each forward whose result the host reads (a verification, a check of
    first tokens) costs the replay ``wait`` plain steps, and the policy
    learns it as idle time: the fixed policy's forwards are the same with it
    and cost that much more; the adaptive policy stops verifying drafts that
    cannot pay for it."""
    (none,) = simulate(CORPUS, KNOBS)
    (waits,) = simulate(CORPUS, KNOBS, wait=0.5)
    assert waits["steps"] == none["steps"] and waits["drafted"] == none["drafted"] == 7
    drafter = SuffixDrafter(**KNOBS)
    costs = [replay(drafter, r, wait=0.5)[0] for r in CORPUS]
    reads = drafter.stats.waits  # record 2: a check and two verifications
    assert reads == 3 and sum(costs) == pytest.approx(17.24 + 0.5 * reads)
    assert drafter.policy.wait_s >= 0.5 * DEFAULT_STEP_SECONDS
    wrong = [Record([5, 6, 7, 8] * 4, [5, 6, 1000 + 3 * k, 1001 + 3 * k]) for k in range(20)]
    adaptive = {**KNOBS, "policy": "adaptive"}
    (cheap,) = simulate(wrong, adaptive)
    (dear,) = simulate(wrong, adaptive, wait=2.0)
    assert cheap["drafted"] > 0 and dear["drafted"] < cheap["drafted"]


def test_a_request_risks_no_more_than_its_credit():
    """Where a draft token costs nearly a plain step (4-bit on a CPU), a
    long repeat whose estimates look sure but whose answer leaves it half
    way is verified in drafts the request's credit can lose (the
    allowance, then what drafts saved): it costs at most the allowance
    beyond stock's plain steps. (Without the credit: one 39-token
    verification, 19 accepted, 95.7 plain steps for 80 tokens.)"""
    dear = {1: 1.0, 2: 1.98, 5: 4.57, 11: 10.02, 30: 26.76}
    text = list(range(100, 140))
    record = Record(text * 3, text[:20] + list(range(500, 560)))
    step = DEFAULT_STEP_SECONDS
    drafter = SuffixDrafter(cost=VerifyCost({n: t * step for n, t in dear.items()}))
    total, _ = replay(drafter, record, cost_from_times(dear), step)
    snap = drafter.snapshot()
    assert snap["accepted"] >= 10  # the repeat was drafted
    assert max(map(int, snap["lengths"])) <= 5  # 4 plain steps' loss: cost(6) - 1 on this curve
    assert total <= len(record.response) + RequestTrust.ALLOWANCE


def test_a_request_risks_no_more_than_its_credit_before_wide_forwards_are_seen():
    """The curve a model starts with has a 1- and a 2-token point, and past
    them it errs cheap (here, as a small model's on a CPU, a 65-token
    forward costs 20 plain steps; the 1-2 slope says 2.3). A request's
    credit prices a draft at the most its forward may cost: past the widest
    forward measured, proportionally to it. So a long first draft that
    fails after its first token (a repeat the answer leaves at once) costs
    at most the allowance beyond stock's plain steps. (Priced on the curve
    instead: one 64-token verification, 1 accepted, 19 plain steps lost.)"""
    true = {1: 1.0, 2: 1.3, 9: 3.4, 17: 5.8, 33: 10.6, 65: 20.2}
    text = list(range(100, 180))
    record = Record(text * 3, text[:2] + list(range(500, 580)))
    step = DEFAULT_STEP_SECONDS
    drafter = SuffixDrafter(cost=VerifyCost({1: step, 2: 1.02 * step}))
    total, _ = replay(drafter, record, cost_from_times(true), step)
    assert drafter.snapshot()["drafted"] > 0
    assert total <= len(record.response) + RequestTrust.ALLOWANCE, (total, drafter.snapshot()["lengths"])


def test_recommend_and_server_command():
    results = simulate(
        CORPUS, {"num_draft_tokens": [16, 2, 8], "max_spec_factor": 1.0, "policy": "fixed"}
    )
    best = recommend(results)
    assert best["est_speedup"] == max(r["est_speedup"] for r in results)
    # 8 and 16 tie on this corpus: the smaller draft wins.
    assert best["num_draft_tokens"] == 8
    assert server_command(best, "my model") == (
        "mlx_lm.server --model 'my model' --draft suffix --num-draft-tokens 8 "
        f"--suffix-max-tree-depth {DEFAULT_MAX_TREE_DEPTH} --suffix-max-spec-factor 1 "
        "--suffix-max-spec-offset 0 --suffix-min-token-prob 0.1 "
        "--suffix-max-cached-requests 10000 --suffix-policy fixed"
    )
    with pytest.raises(ValueError):
        recommend([])


def test_text_records(tiny_model_path, models_dir, monkeypatch):
    """Text goes through the tiny model's tokenizer by default, the same one
    a model folder's tokenizer.json holds."""
    monkeypatch.setenv("MLX_LM_SUFFIX_HOME", str(models_dir))
    text = "def add(a, b):\n    return a + b\n"
    recs = [{"prompt": "Write add.", "response": text}, {"prompt": "Again.", "response": text}]
    by_default = tokenize_records(recs)
    by_path = tokenize_records(recs, str(tiny_model_path))
    assert by_default == by_path
    ids = load_encoder(None)(text)
    assert by_default[1].response == ids and len(ids) > 5
    (res,) = simulate(recs, KNOBS)
    assert res["tokens"] == 2 * len(ids)
    assert res["accepted"] > 0


def _write_log(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_cli_simulate(tmp_path):
    log = tmp_path / "log.jsonl"
    _write_log(log, [r._asdict() for r in CORPUS] + [{"prompt": [7], "response": RESPONSE}])
    out = tmp_path / "out" / "res.json"
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"1": 118, "2": 119, "4": 146, "8": 158, "16": 194}))
    result = CliRunner().invoke(
        main,
        [
            "simulate",
            str(log),
            "--num-draft-tokens",
            "4,8",
            "--min-token-prob",
            "0.1",
            "--policy",
            "adaptive,fixed",
            "--cost-file",
            str(costs),
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "4 records, 33 response tokens" in result.output
    assert "est.speedup" in result.output
    assert "Recommended" in result.output
    assert "mlx_lm.server --draft suffix --num-draft-tokens " in result.output
    data = json.loads(out.read_text())
    assert len(data["results"]) == 2 * 2 * 2 * 2  # draft x depth x factor x policy
    assert {r["policy"] for r in data["results"]} == {"adaptive", "fixed"}
    assert data["recommended"] == recommend(data["results"])
    assert data["command"] in result.output
    # The host's wait after each read: the fixed policy's forwards cost more.
    waits = tmp_path / "waits.json"
    args = ["simulate", str(log), "--num-draft-tokens", "8", "--max-tree-depth", "64",
            "--max-spec-factor", "1", "--min-token-prob", "0.1", "--policy", "fixed", "--json"]
    assert CliRunner().invoke(main, [*args, str(out)]).exit_code == 0
    result = CliRunner().invoke(main, [*args, str(waits), "--wait-ms", "5"])
    assert result.exit_code == 0, result.output
    (plain,), (waited,) = (json.loads(p.read_text())["results"] for p in (out, waits))
    assert waited["drafted"] == plain["drafted"] > 0
    assert waited["est_speedup"] < plain["est_speedup"]


def test_cli_simulate_bad_log(tmp_path):
    log = tmp_path / "log.jsonl"
    _write_log(log, [{"prompt": [1]}])
    result = CliRunner().invoke(main, ["simulate", str(log)])
    assert result.exit_code != 0
    assert "needs 'prompt' and 'response'" in result.output
    with pytest.raises(ValueError, match="log.jsonl:1"):
        read_records(log)
    _write_log(log, [r._asdict() for r in CORPUS])
    result = CliRunner().invoke(main, ["simulate", str(log), "--policy", "greedy"])
    assert result.exit_code != 0 and "policy must be one of" in result.output


def test_replay_learns_the_cost_curve_as_the_loop_does():
    """The policy starts from the forwards the loop calibrates (1 and 2
    tokens, in seconds of the given step) and learns the rest as the loop
    does, from each verification (not from the prompt's prefill)."""
    from mlx_lm_suffix.tools.simulate import policy_cost

    cost = cost_from_times({1: 1.0, 2: 1.1, 8: 1.5, 4096: 200.0})
    step = 0.004
    d = SuffixDrafter(num_draft_tokens=8, policy="adaptive", cost=policy_cost(cost, step))
    assert d.policy.cost.points == pytest.approx({1: step, 2: 1.1 * step})
    replay(d, Record(list(range(3000, 5000)), RESPONSE), cost, step)
    assert set(d.policy.cost.points) <= set(range(1, 10))  # no 2,000-token point
    replay(d, Record(list(range(10, 20)), RESPONSE), cost, step)  # RESPONSE drafted in full
    widths = set(d.policy.cost.points) - {1, 2}
    assert widths and all(3 <= n <= 9 for n in widths)


def test_replay_learns_plain_steps_as_the_loop_does():
    """As the loop times each plain step that follows another, the replay's
    policy learns its 1-token point from them: a plain step dearer than
    the calibration (a long context) moves the point to it; a verification
    or a read in between starts the run again."""
    from mlx_lm_suffix.policy.rules import PLAIN_STEPS

    step = 0.002
    curve = cost_from_times({1: 1.0, 2: 1.5})

    def dear(k: int) -> float:  # a plain step at this context: 1.4 calibrated ones
        return 1.4 if k == 0 else curve(k)

    plain = Record([1, 2], list(range(500, 500 + PLAIN_STEPS + 2)))  # nothing to draft
    d = SuffixDrafter(policy="adaptive", cost=VerifyCost({1: step, 2: 1.5 * step}))
    replay(d, plain, dear, step)
    assert d.stats.drafted == 0 and d.policy.cost.points[1] > step
    assert d.policy.cost.points[1] <= 1.4 * step
    short = Record([1, 2], list(range(700, 700 + PLAIN_STEPS)))  # one fewer than a mean
    d = SuffixDrafter(policy="adaptive", cost=VerifyCost({1: step, 2: 1.5 * step}))
    replay(d, short, dear, step)
    assert d.policy.cost.points[1] == step


@pytest.mark.parametrize("line", [
    '{"prompt": 5, "response": "y"}', '{"prompt": [1, -5], "response": [1, 2]}',
    '{"prompt": [1.5, 2], "response": [1, 2]}', '{"prompt": [1, 2], "response": [true, 2]}',
    '{"prompt": [1, 99999999999], "response": [1, 2]}', "",
])
def test_cli_simulate_refuses_bad_token_ids_and_empty_logs(tmp_path, line):
    """A record whose prompt or response is neither text nor a list of
    token ids, or a log without records, gets one line saying so (they gave
    tracebacks, ids cut by int(), or a table of 0.00x with a recommended
    command)."""
    log = tmp_path / "log.jsonl"
    log.write_text(line + "\n" if line else "")
    result = CliRunner().invoke(main, ["simulate", str(log)])
    assert result.exit_code != 0
    assert "record 1" in result.output or "no records" in result.output
    assert "Recommended" not in result.output and "Traceback" not in result.output
