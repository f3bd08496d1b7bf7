"""`tether demo --quick` end to end (the CI version of the README's main job)."""

import json

import pytest

from tether.cli import main
from tether.demo.pipeline import BETA

POS = f"beta_{BETA:g}"  # the tethered run


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo"
    assert main(["demo", "--quick", "--output-dir", str(out), "--seed", "0"]) == 0
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_demo_quick_runs_every_stage_on_real_samples(quick_demo):
    out, results = quick_demo
    assert results["mode"] == "quick"
    assert BETA > 0 and set(results["runs"]) == {POS, "beta_0"} and results["beta"] == BETA
    assert results["runs"]["beta_0"]["kl_coef"] == 0.0 and results["runs"][POS]["kl_coef"] == BETA
    for run in results["runs"].values():
        curves = run["curves"]
        assert len(curves["step"]) == results["settings"]["ppo_steps"]
        assert len(curves["rm_reward"]) == len(curves["kl"]) == len(curves["response_length"]) == len(curves["step"])
        assert curves["eval_step"] and len(curves["gold_accuracy"]) == len(curves["eval_step"])
        assert curves["eval_step"][0] == 0  # the SFT baseline evaluated by the PPO run itself
        assert run["final"]["n"] == results["settings"]["n_eval"]
    # The same numbers as the SFT stage measured, re-derived from the McNemar counts of the final evaluation.
    from tether.core.stats import mcnemar_exact

    for run in results["runs"].values():
        f = run["final"]
        assert f["mcnemar_p_vs_sft"] == mcnemar_exact(f["only_ppo_correct"], f["only_sft_correct"])
        assert f["accuracy"] - results["sft"]["accuracy"] == pytest.approx(
            (f["only_ppo_correct"] - f["only_sft_correct"]) / f["n"])
    # The pairs are real samples labelled by the gold rule: chosen is the answer, rejected is not.
    from tether.demo.task import solve

    pairs = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    assert pairs and all(p["chosen"] == solve(p["prompt"]) != p["rejected"] for p in pairs)
    # The beta = 0 exhibits are real responses from the run's own samples, with their KL.
    samples = [json.loads(line) for f in (out / "ppo_beta_0" / "samples").glob("*.jsonl")
               for line in f.read_text().splitlines()]
    for exhibit in results["beta0_exhibits"]:
        assert exhibit in samples and "kl" in exhibit
    page = (out / "report.html").read_text()
    assert "beta = 0" in page and "<img" in page and "http://" not in page and "https://" not in page
    assert set(results["stage_seconds"]) >= {"b. SFT on addition", "d. reward model (Bradley-Terry) on the pairs"}


@pytest.mark.slow
def test_demo_quick_shows_the_story(quick_demo):
    """The story's directions --quick shows: the reward model beats chance on held-out pairs; both PPO runs
    leave the reference, the β > 0 one paying β·KL in its reward and the β = 0 one nothing, and without the
    tether the policy drifts further (seed 0 on a 2-core EPYC: final KL 0.35 vs 0.10, summed 1.28 vs 0.63)."""
    out, results = quick_demo
    rm = results["reward_model"]
    assert rm["excludes_chance"] and rm["wilson_low"] > 0.5
    for name, beta in ((POS, BETA), ("beta_0", 0.0)):
        rows = [json.loads(line) for line in (out / f"ppo_{name}" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "objective/kl" in r]
        assert steps[-1]["objective/kl"] > 0.01  # the policy left the reference
        for r in steps:  # rlhf reward = score − β · (sequence KL), row by row, from the run's own metrics
            assert r["objective/kl_coef"] == beta
            assert r["objective/rlhf_reward"] == pytest.approx(
                r["objective/scores"] - beta * r["objective/kl_sequence"], abs=1e-5)
        assert max(r["objective/kl_sequence"] for r in steps) > 0.1  # so the β = 0.2 check is not 0 = 0
    kl = {name: run["curves"]["kl"] for name, run in results["runs"].items()}
    assert kl["beta_0"][-1] > kl[POS][-1] and sum(kl["beta_0"]) > sum(kl[POS])
