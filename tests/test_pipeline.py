"""`tether rlhf` on a tiny policy: every stage, one refresh round, the control arm (and the DPO arm where this
tether has `tether dpo`), killed between two stages and inside a PPO arm, then resumed; bad tasks as one-line errors.

The gold rule is tests/pipeline_rules.py's ``has_one``: a random tiny policy's replies pass it about a quarter of
the time, so its own samples give pairs (it never adds two numbers)."""

import json
import math

import pytest

from tether.cli import main
from tether.pipeline.dpo_arm import dpo_available
from tether.pipeline.run import MARKER, RLHFPipeline
from tiny import make_policy_dir, make_prompts_file

ARM = "ppo_beta0.04_r0"  # the tethered arm of round 0: the one killed inside
EARLY = ("task", "sft", "pairs_r0", "rm_r0")  # the stages complete before the kill between stages


class Killed(Exception):
    pass


class KillAtStep:
    """A PPO callback that kills the run at ``step`` (the step before it was checkpointed: ``ppo.save_every`` 1)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, record):
        if record.step == self.step:
            raise Killed(f"killed at step {record.step}")


def config(root, policy, prompts, **over) -> dict:
    (root / "sample.yaml").write_text("accept:\n  require_eos: false\n")  # 6-token random replies rarely end
    # sampled held-out answers: a random policy's greedy ones are one text for every prompt, whose gold never moves
    (root / "ppo.yaml").write_text("eval:\n  greedy: false\n")
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    (root / "sft.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "completion": "1" + r["answer"]}) + "\n"
                                            for r in rows))
    cfg = {"output_dir": str(root / "out"), "estimate": False,
           "model": {"policy": str(policy)}, "sft": {"data": str(root / "sft.jsonl"), "steps": 2},
           "task": {"prompts": str(prompts), "gold": "pipeline_rules:has_one", "max_new_tokens": 6, "temperature": 1.0},
           "pairs": {"samples_per_prompt": 4, "batch_size": 16, "length_gap": 0, "config": str(root / "sample.yaml")},
           "rm": {"epochs": 1, "batch_size": 8},
           "ppo": {"steps": 2, "batch_size": 4, "samples_per_prompt": 4, "eval_every": 1, "eval_n": 10,
                   "control": True, "save_every": 1, "beta0_steps": 3, "config": str(root / "ppo.yaml")},
           "refresh": {"rounds": 1}, "dpo": {"run": dpo_available()}}
    for key, value in over.items():
        section, _, leaf = key.partition("__")
        cfg[section] = {**cfg[section], leaf: value} if leaf else value
    return cfg


def markers(out) -> dict:
    return {name: ((out / name / MARKER).stat().st_mtime_ns, (out / name / MARKER).read_text()) for name in EARLY}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three invocations on one folder: killed after rm_r0; killed inside the first PPO arm; then to the end."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("rlhf")
    cfg = config(root, make_policy_dir(root), make_prompts_file(root, n=30))
    out, printed = root / "out", []

    def stop_after(name):
        if name == "rm_r0":
            raise Killed("killed after rm_r0")

    for kwargs, first in (({"after_stage": stop_after}, True), ({"callbacks": [KillAtStep(2)]}, False), ({}, False)):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            try:
                results = RLHFPipeline({**cfg, "estimate": first}, **kwargs).run()
            except Killed:
                results = None
        done = sorted(d.name for d in out.iterdir() if (d / MARKER).is_file())
        printed.append((buffer.getvalue(), markers(out) if (out / "rm_r0" / MARKER).exists() else None, done))
    return out, printed, results


@pytest.mark.slow
def test_every_stage_arm_and_round(runs):
    out, _, results = runs
    assert results is not None
    arms = {"beta0.04": {"0", "1"}, "beta0": {"0"}, "control": {"0"}, **({"dpo": {"0"}} if dpo_available() else {})}
    assert {arm: set(rounds) for arm, rounds in results["arms"].items()} == arms
    assert set(results["pairs"]) == {"pairs_r0", "pairs_r1"} and set(results["reward_models"]) == {"rm_r0", "rm_r1"}
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["arms"].keys() == results["arms"].keys()
    # SFT first: the pairs are the SFT policy's, the reward model is initialised from it, the arms start from it
    assert results["pairs"]["pairs_r0"]["policy"] == str(out / "sft")
    assert results["reward_models"]["rm_r0"]["backbone"] == str(out / "sft")
    assert f"policy: {out / 'sft'}" in (out / "ppo_beta0_r0" / "config.yaml").read_text()
    assert json.loads((out / "sft" / MARKER).read_text())["steps"] == 2
    # the refresh round: pairs from the tethered arm's policy, a reward model on both rounds' pairs, PPO from it
    assert results["pairs"]["pairs_r1"]["policy"] == str(out / ARM / "policy")
    assert results["reward_models"]["rm_r1"]["pairs_files"] == [str(out / f"pairs_r{r}" / "pairs.jsonl")
                                                                for r in (0, 1)]
    saved = {name: (out / name / "config.yaml").read_text() for name in ("ppo_beta0.04_r1", "ppo_beta0_r0",
                                                                          "ppo_control_r0")}
    assert f"policy: {out / ARM / 'policy'}" in saved["ppo_beta0.04_r1"] and "rm_r1" in saved["ppo_beta0.04_r1"]
    assert "coef: 0.0\n" in saved["ppo_beta0_r0"] and "shuffle: true" in saved["ppo_control_r0"]
    # the pairs are the policy's own replies labelled by the gold rule: right ≻ wrong
    pairs = [json.loads(x) for x in (out / "pairs_r0" / "pairs.jsonl").read_text().splitlines()]
    assert pairs and all("1" in p["chosen"] and "1" not in p["rejected"] for p in pairs)
    rm = results["reward_models"]["rm_r0"]
    assert rm["held_out"]["n_pairs"] > 0 and 0.0 <= rm["probe"]["mean_auc"] <= 1.0
    for arm, rounds in results["arms"].items():
        for r, rr in rounds.items():
            if arm != "dpo":
                steps = 3 if arm == "beta0" else 2  # --beta0-steps: the beta = 0 arm's own budget
                assert [e["step"] for e in rr["evals"]] == [steps * int(r) + k for k in range(steps + 1)]
                assert rr["s_per_step"] > 0 and rr["doctor"]["level"] in ("HEALTHY", "WARNING", "UNHEALTHY")
            for e in rr["evals"]:
                assert e["p_vs_step0"] == pytest.approx(exact_mcnemar(e["gained"], e["lost"]))
    if dpo_available():  # the DPO arm: trained on pairs_r0 from the same start, judged on the same problems
        dpo = json.loads((out / "dpo_r0" / MARKER).read_text())
        assert isinstance(dpo["preference_accuracy"], float) and dpo["steps"] > 0
        assert dpo["eval"]["eval/n"] == results["step0"]["n"] == len(dpo["eval"]["eval/correct"])
        # DPO against each PPO arm's last evaluation, problem by problem (McNemar by the binomial sum)
        compared = {c["arm"]: c for c in results["dpo_vs_ppo"]}
        assert set(compared) == set(arms) - {"dpo"}
        for arm, c in compared.items():
            last = results["arms"][arm][max(results["arms"][arm], key=int)]["evals"][-1]
            pairs = list(zip(dpo["eval"]["eval/correct"], last["correct"]))
            assert (c["only_dpo"], c["only_ppo"]) == (pairs.count(("1", "0")), pairs.count(("0", "1")))
            assert c["p"] == pytest.approx(exact_mcnemar(c["only_dpo"], c["only_ppo"]))
            assert c["step"] == last["step"]
    # every arm against the control at the control's evaluated steps (1 and 2), counted by hand
    control = {e["step"]: e["correct"] for e in results["arms"]["control"]["0"]["evals"] if e["step"] > 0}
    seen = set()
    for c in results["vs_control"]:
        e = next(e for e in results["arms"][c["arm"]][str(c["round"])]["evals"] if e["step"] == c["step"])
        pairs = list(zip(e["correct"], control[c["control_step"]]))
        assert (c["only_arm"], c["only_control"]) == (pairs.count(("1", "0")), pairs.count(("0", "1")))
        assert c["p"] == pytest.approx(exact_mcnemar(c["only_arm"], c["only_control"]))
        seen.add((c["arm"], c["round"], c["step"]))
    assert {("beta0.04", 0, 1), ("beta0.04", 0, 2), ("beta0", 0, 1), ("beta0", 0, 2)} <= seen
    assert ("beta0", 0, 3) not in seen  # the control has no step 3
    # a refresh round's first evaluation is the round before's last policy: paired with the control once
    assert len({(arm, step) for arm, _, step in seen}) == len(results["vs_control"])
    report = (out / "report.md").read_text()
    assert all(f"| {arm} | " in report for arm in arms) and "Wilson" in report
    assert "against the shuffled-reward control" in report
    assert ("DPO against each PPO arm" in report) == dpo_available()


def exact_mcnemar(b: int, c: int) -> float:
    """Two-sided exact McNemar by the binomial sum : 2 · P(X ≤ min(b, c)), X ~ Bin(b + c, ½), at most 1."""
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2 ** n)


@pytest.mark.slow
def test_held_out_results_are_the_arms_own_evaluations(runs):
    """The table's step-k accuracy and gains are those of the arm's metrics.jsonl against the step-0 row."""
    out, _, results = runs
    rows = [json.loads(x) for x in (out / "ppo_beta0_r0" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/correct" in r]
    base = evals[0]["eval/correct"]
    for row, point in zip(evals, results["arms"]["beta0"]["0"]["evals"]):
        c = row["eval/correct"]
        assert point["accuracy"] == pytest.approx(c.count("1") / len(c))
        assert point["gained"] == sum(a > b for a, b in zip(c, base))
        assert point["lost"] == sum(a < b for a, b in zip(c, base))


@pytest.mark.slow
def test_a_kill_between_stages_resumes_at_the_next_stage(runs):
    out, printed, _ = runs
    (first, after_first, done_first), (second, after_second, done_second), (third, after_third, _) = printed
    assert "expected time on this machine" in first and "pairs_r0" in first  # the plan, priced, before it starts
    assert "re-priced" in first  # each priced stage, once done, re-prices the rest from what it took
    assert done_first == sorted(EARLY)  # stopped right after rm_r0: no PPO arm complete
    assert done_second == sorted(EARLY)  # killed inside the first PPO arm: nothing more complete
    for text in (second, third):
        for name in EARLY:
            assert f"== {name}: skipped" in text
    assert after_first == after_second == after_third  # the earlier stages' markers untouched (time and content)


@pytest.mark.slow
def test_a_kill_inside_ppo_resumes_from_its_checkpoint(runs):
    out, printed, _ = runs
    assert "resuming" not in printed[1][0].split(f"== {ARM}:")[1].split("\n")[0]
    line = printed[2][0].split(f"== {ARM}:")[1].split("\n")[0]
    assert "resuming from" in line and "checkpoints" in line
    rows = [json.loads(x) for x in (out / ARM / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "objective/kl" in r] == [1, 2]  # step 2 once: redone after the kill
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1, 2]


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    return make_policy_dir(tmp_path_factory.mktemp("policy"))


@pytest.mark.parametrize("args, says", [
    (["--task", "rg:no_such_dataset"], "rg:no_such_dataset"),
    (["--task", "rg:chain_sum", "--policy", "no/such_policy_dir"], "no/such_policy_dir"),
    (["--task", "rg:chain_sum", "--sft-data", "missing-sft.jsonl"], "missing-sft.jsonl"),
    (["--task", "missing.jsonl", "--gold", "pipeline_rules:has_one"], "missing.jsonl"),
    (["--task", "PROMPTS"], "--gold: required"),
    (["--task", "PROMPTS", "--gold", "pipeline_rules:no_such_rule"], "--gold"),
    (["--task", "rg:chain_sum:no_such_knob=3"], "no_such_knob"),
])
def test_a_bad_input_is_one_line(tmp_path, capsys, tiny_policy, args, says):
    prompts = make_prompts_file(tmp_path, n=4)
    args = [str(prompts) if a == "PROMPTS" else a for a in args]
    assert main(["rlhf", "--policy", str(tiny_policy), "--output-dir", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tether rlhf: error:") and "\n" not in err and says in err
    assert not (tmp_path / "out").exists()  # nothing written before the inputs are good


def test_yaml_then_flags(tmp_path):
    from tether.cli import build_parser, parse
    from tether.config import resolve_config
    from tether.pipeline.config import RLHFConfig

    path = tmp_path / "rlhf.yaml"
    path.write_text("ppo:\n  steps: 5\n  kl_coef: 0.1\nrefresh:\n  rounds: 2\n")
    args = parse(build_parser("rlhf"), ["rlhf", "--config", str(path), "--steps", "3", "--policy", "p",
                                        "--task", "rg:chain_sum"])
    cfg = resolve_config(RLHFConfig, args, args.config)
    assert (cfg.ppo.steps, cfg.ppo.kl_coef, cfg.refresh.rounds, cfg.task.prompts) == (3, 0.1, 2, "rg:chain_sum")


def test_pairwise_auc_by_hand():
    import torch

    from tether.core.ranking import pairwise_auc

    # positives 3, 1; negatives 2, 1: (3>2) (3>1) (1<2) (1=1 → ½) = 2.5 / 4
    assert pairwise_auc(torch.tensor([3.0, 1.0]), torch.tensor([2.0, 1.0])) == pytest.approx(0.625)
    assert pairwise_auc(torch.tensor([5.0]), torch.tensor([1.0, 2.0])) == 1.0
    assert pairwise_auc(torch.tensor([0.0]), torch.tensor([1.0, 2.0])) == 0.0
    with pytest.raises(ValueError):
        pairwise_auc(torch.tensor([]), torch.tensor([1.0]))


@pytest.mark.parametrize("example", ["rlhf-chain-sum.yaml", "rlhf-products.yaml"])
def test_the_example_config_is_recipe_5_wired(example):
    """The example pipelines load; their PPO arms get recipe 5's settings from its stage YAML and the pipeline's
    wiring over them (this arm's policy, reward model, beta and steps); beta = 0 runs 20 steps, the others 10; the
    DPO arm's YAML is tether dpo's."""
    from pathlib import Path

    from tether.config import as_config, load_yaml
    from tether.dpo.config import DPOConfig
    from tether.pipeline.config import RLHFConfig
    from tether.pipeline.stages import ppo_config

    root = Path(__file__).resolve().parents[1]
    cfg = as_config(RLHFConfig, str(root / "examples" / example))
    for section in (cfg.pairs, cfg.ppo, cfg.dpo):
        section.config = str(root / section.config)
    steps = {st.name: st.arm[4] for st in RLHFPipeline(cfg).plan() if st.kind == "ppo"}
    assert steps == {"ppo_beta0.04_r0": 10, "ppo_beta0_r0": 20, "ppo_control_r0": 10, "ppo_beta0.04_r1": 10}
    dpo = DPOConfig()
    load_yaml(dpo, cfg.dpo.config)
    assert (dpo.optim.lr, dpo.loss.beta, dpo.data.packing) == (5e-5, 0.1, True)
    ppo = ppo_config(cfg, Path("task"), "runs/x/policy", "runs/x/rm_r1", 0.0, False, Path("runs/x/ppo_beta0_r1"))
    assert (ppo.kl.coef, ppo.steps, ppo.reward.sources, ppo.model.policy) == (0.0, 10, ["runs/x/rm_r1"],
                                                                             "runs/x/policy")
    assert (ppo.advantage.estimator, ppo.kl.estimator, ppo.ppo.packing, ppo.model.lora_r) == ("grpo", "k3", True, 16)
    assert ppo.data.eval_prompts == str(Path("task") / "heldout.jsonl") and ppo.reward.gold.endswith(
        "reasoning_gym_correct")


def test_a_rerun_with_other_settings_is_named(tmp_path):
    """Complete stages are kept whatever the settings; a rerun with other ones says which keys changed."""
    from tether.config import save_config

    cfg = {"output_dir": str(tmp_path), "model": {"policy": "p"}, "task": {"prompts": "rg:chain_sum"}}
    first = RLHFPipeline(cfg)
    assert first.changed_settings() == ""  # a new folder
    save_config(first.cfg, tmp_path / "config.yaml")
    assert RLHFPipeline({**cfg, "estimate": False}).changed_settings() == ""  # not a setting of any stage
    again = RLHFPipeline({**cfg, "ppo": {"steps": 20}})
    assert again.changed_settings() == "ppo.steps 10 -> 20"


def test_the_rest_is_re_priced_from_the_done_stages_of_each_kind():
    """By hand: pairs took 2x their estimate, so the second pairs stage is priced 2x; no PPO arm has run, so the PPO
    arms keep their estimate; a stage without an estimate adds nothing."""
    from types import SimpleNamespace as Stage

    from tether.pipeline.estimate import repriced_remaining

    plan = [Stage(name="task", kind="task"), Stage(name="pairs_r0", kind="pairs"), Stage(name="rm_r0", kind="rm"),
            Stage(name="ppo_a", kind="ppo"), Stage(name="ppo_b", kind="ppo"), Stage(name="pairs_r1", kind="pairs"),
            Stage(name="sft", kind="sft")]
    estimated = {"task": 0.0, "pairs_r0": 100.0, "rm_r0": 50.0, "ppo_a": 30.0, "ppo_b": 30.0, "pairs_r1": 100.0,
                 "sft": None}
    assert repriced_remaining(plan, estimated, {"pairs_r0": 200.0}) == 50.0 + 30.0 + 30.0 + 2 * 100.0
    assert repriced_remaining(plan, estimated, {"pairs_r0": 200.0, "rm_r0": 25.0, "ppo_a": 3.0}) == 3.0 + 200.0
    assert repriced_remaining(plan, {k: None for k in estimated}, {}) is None


def test_an_rg_task_is_priced_on_the_problems_its_split_holds():
    """Two one-digit terms hold few distinct problems: the estimate counts the split's training rows, not the 2000
    asked for (it priced recipe 5's pairs at 20x)."""
    from tether.pipeline.config import RLHFConfig
    from tether.pipeline.estimate import training_problems
    from tether.tasks import split_rows

    cfg = RLHFConfig()
    cfg.task.prompts, cfg.task.task_train = "rg:chain_sum:min_terms=2,max_terms=2,min_digits=1,max_digits=1", 2000
    n = training_problems(cfg)
    assert n == len(split_rows(cfg.task.prompts, 2000, cfg.ppo.eval_n, cfg.task.task_seed)[0]) < 200
