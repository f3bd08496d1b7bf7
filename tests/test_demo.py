"""`tether demo --quick` end to end (the CI version of the README's main job)."""

import json

import pytest

from tether.cli import main


@pytest.mark.slow
def test_demo_quick_end_to_end(tmp_path):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--output-dir", str(out), "--seed", "0"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["mode"] == "quick"
    assert set(results["runs"]) == {"beta_0.2", "beta_0"}
    assert results["runs"]["beta_0"]["kl_coef"] == 0.0 and results["runs"]["beta_0.2"]["kl_coef"] == 0.2
    for run in results["runs"].values():
        curves = run["curves"]
        assert len(curves["step"]) == results["settings"]["ppo_steps"]
        assert len(curves["rm_reward"]) == len(curves["kl"]) == len(curves["response_length"]) == len(curves["step"])
        assert curves["eval_step"] and len(curves["gold_accuracy"]) == len(curves["eval_step"])
        final = run["final"]
        assert final["n"] == results["settings"]["n_eval"] and final["low"] <= final["accuracy"] <= final["high"]
    assert 0.0 <= results["sft"]["accuracy"] <= 1.0 and results["sft"]["n"] >= 200
    assert {"accuracy", "wilson_low", "wilson_high", "excludes_chance"} <= results["reward_model"].keys()
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
    assert set(results["stage_seconds"]) >= {"b. SFT on 3-digit addition", "d. reward model (Bradley-Terry) on the pairs"}
