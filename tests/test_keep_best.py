"""--keep-best (issue #54): the checkpoint of the best held-out evaluation in RUN_DIR/best, chosen by a planted
sequence of evaluations (the evaluator replaced, so the test decides which step is best); its weights are the
policy's at that step; the periodic rotation leaves it; a save that fails keeps the previous best; a resumed run
judges against the best it carried; and the doctor names the best step of a run whose gold fell after a peak."""

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file
from tiny import make_policy_dir, make_prompts_file, tiny_config

import tether.ppo.resume as resume_module
import tether.ppo.train as train_module
from tether.checkpoint import clean_temporary, list_checkpoints
from tether.diagnostics.best import BestEvaluation, consider, history_best
from tether.diagnostics.doctor import diagnose_run
from tether.ppo.train import PPOTrainer

N = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("keep_best")
    return make_policy_dir(root), make_prompts_file(root)


def planted(accuracy: dict[int, float]):
    """An evaluator giving, at step s, accuracy ``accuracy[s]`` on N problems (the first k right)."""
    def evaluate(run, cfg, step):
        k = round(accuracy[step] * N)
        return {"eval/reward": accuracy[step], "eval/reward_std": 0.5, "eval/n": N, "eval/accuracy": k / N,
                "eval/correct": "1" * k + "0" * (N - k)}, []
    return evaluate


def config(root, files, steps, **kw):
    return tiny_config(root, *files, steps=steps, data__eval_fraction=0.25, eval__every=1, eval__at_start=True,
                       eval__keep_best=True, save_every=1, keep_checkpoints=2, save_every_minutes=0.0, **kw)


def run_steps(cfg, resume=False):
    """Run ``cfg`` step by step; returns the policy's weights after each step (step 0: before the first)."""
    trainer = PPOTrainer(cfg, resume=resume)
    weights = {trainer.steps_done: clone(trainer)}
    while trainer.steps_done < cfg.steps:
        trainer.step()
        weights[trainer.steps_done] = clone(trainer)
    trainer.finish()
    return weights


def clone(trainer):
    return {k: v.detach().clone() for k, v in trainer.run.models.unwrapped_policy.state_dict().items()}


def same_weights(directory, weights):
    saved = load_file(str(directory / "model.safetensors"))
    # the saved file leaves a tied lm_head out; every tensor it holds equals the policy's at that step
    return len(saved) > 0 and all(torch.equal(saved[k], weights[k]) for k in saved)


def best_json(run):
    return json.loads((run / "best" / "best.json").read_text())


def test_best_holds_the_best_steps_weights_and_survives_rotation(files, tmp_path, monkeypatch):
    # step 4 ties step 2 (the earlier is kept), step 5 falls: the best is step 2
    monkeypatch.setattr(train_module, "evaluate", planted({0: .25, 1: .5, 2: .75, 3: .5, 4: .75, 5: .25}))
    cfg = config(tmp_path, files, steps=5)
    weights = run_steps(cfg)
    run = tmp_path / "run"
    assert [p.name for p in list_checkpoints(run)] == ["step_000004", "step_000005"]  # step 2's rotated away
    info = best_json(run)
    assert (info["step"], info["measure"], info["value"], info["n"]) == (2, "accuracy", 0.75, N)
    assert (info["previous_step"], info["gained"], info["lost"], info["candidates"]) == (1, 2, 0, 3)
    assert info["p_gain"] == pytest.approx(0.25)  # two of two discordant problems gained: 1/4
    assert same_weights(run / "best" / "policy", weights[2]) and not same_weights(run / "best" / "policy", weights[5])
    assert same_weights(run / "best" / "model", weights[2])  # the plain model beside it, tokenizer included
    assert (run / "best" / "model" / "tokenizer_config.json").is_file()
    state = torch.load(run / "best" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 2 and state["health"]["best"]["best"]["step"] == 2  # a checkpoint of step 2, resumable
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "best" / "model")  # loads as a plain model


def test_a_failed_save_keeps_the_previous_best(files, tmp_path, monkeypatch):
    monkeypatch.setattr(train_module, "evaluate", planted({0: .25, 1: .5, 2: .75}))
    real = resume_module.best_files

    def failing(run, cfg, best, state):
        also = real(run, cfg, best, state)

        def write(tmp):
            also(tmp)  # the new best is half written in the temporary folder, then the process "dies"
            if best["step"] == 2:
                raise KeyboardInterrupt("killed mid-save")
        return write

    monkeypatch.setattr(resume_module, "best_files", failing)
    cfg = config(tmp_path, files, steps=2)
    trainer = PPOTrainer(cfg)
    weights = {}
    trainer.step()
    weights[1] = clone(trainer)
    with pytest.raises(KeyboardInterrupt):
        trainer.step()
    run = tmp_path / "run"
    assert best_json(run)["step"] == 1 and same_weights(run / "best" / "policy", weights[1])
    assert trainer.best.step == 1  # the best moves only with a complete checkpoint
    assert not [p for p in run.iterdir() if p.name.startswith(".tmp-")]


def test_a_kill_between_the_renames_puts_the_previous_best_back(tmp_path):
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "best.json").write_text('{"step": 3}')
    os.replace(tmp_path / "best", tmp_path / f".old-best-{os.getpid()}")  # atomic_dir's first rename, then killed
    (tmp_path / f".tmp-best-{os.getpid()}").mkdir()  # the new copy, never renamed into place
    clean_temporary(tmp_path)
    assert json.loads((tmp_path / "best" / "best.json").read_text()) == {"step": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def test_resume_judges_against_the_carried_best(files, tmp_path, monkeypatch):
    # best at step 1; steps 3 and 4 are below it: a resumed run that forgot it would take step 3
    sequence = {0: .25, 1: .75, 2: .5, 3: .625, 4: .5}
    monkeypatch.setattr(train_module, "evaluate", planted(sequence))
    straight = config(tmp_path / "a", files, steps=4)
    run_steps(straight)
    first = config(tmp_path / "b", files, steps=2)
    weights = run_steps(first)
    resumed = copy.deepcopy(first)
    resumed.steps = 4
    run_steps(resumed, resume=True)
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert best_json(b)["step"] == 1 and best_json(a) == best_json(b)
    assert same_weights(b / "best" / "policy", weights[1])
    last = torch.load(list_checkpoints(b)[-1] / "trainer_state.pt", weights_only=True)
    carried = {k: v for k, v in best_json(b).items() if k != "rule"}
    assert last["health"]["best"] == {"best": carried, "seen": 5}  # steps 0-4 evaluated


def test_the_rule_ties_and_measures():
    row = lambda step, acc=None, reward=None: {"step": step, "eval/accuracy": acc, "eval/reward": reward}  # noqa: E731
    best = consider(None, row(0, .5, 1.0), 1)
    assert best.step == 0 and best.measure == "accuracy"
    assert consider(best, row(1, .5, 9.0), 2) is None  # a tie in accuracy keeps the earlier, whatever the reward
    assert consider(best, row(1, .625, 0.0), 2).step == 1
    assert consider(best, row(1, None, 9.0), 2) is None  # a reward never beats an accuracy
    by_reward = consider(None, row(0, None, 0.1), 1)
    assert consider(by_reward, row(1, None, 0.1), 2) is None and consider(by_reward, row(1, None, 0.2), 2).step == 1
    assert consider(by_reward, row(2, .1), 3).measure == "accuracy"  # a gold rule appeared: accuracy wins
    assert consider(None, {"step": 1, "eval/reward": float("nan")}, 1) is None
    assert consider(None, {"step": 1, "objective/scores": 1.0}, 1) is None  # no evaluation
    rows = [row(0, .3), {"step": 1, "objective/scores": 2.0}, row(2, .6), row(3, .6), row(4, .4)]
    best, last, seen = history_best(rows)
    assert (best.step, last["step"], seen) == (2, 4, 4)
    assert BestEvaluation.from_dict(best.to_dict()) == best


def planted_history(run, keep_best: bool, checkpoint_steps=()):
    """A run whose gold accuracy peaks at step 20 (70%) and falls to 30% by step 40: the gold band alarms."""
    n = 100
    accuracy = {0: .40, 10: .55, 20: .70, 30: .45, 40: .30}
    rows = []
    for step in range(0, 41):
        row = {"step": step, "objective/scores": 1.0 + 0.01 * step, "objective/kl_coef": 0.0}
        if step in accuracy:
            k = round(accuracy[step] * n)
            # the problems right at the peak are a superset of those right before and after it
            row.update({"eval/accuracy": k / n, "eval/n": n, "eval/correct": "1" * k + "0" * (n - k),
                        "eval/reward": 1.0 + 0.01 * step, "eval/reward_std": 0.1})
        rows.append(row)
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text(f"steps: 40\neval:\n  keep_best: {str(keep_best).lower()}\n")
    for step in checkpoint_steps:
        (run / "checkpoints" / f"step_{step:06d}" / "policy").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step:06d}" / "trainer_state.pt").write_bytes(b"")
    if keep_best:
        (run / "best").mkdir()
        (run / "best" / "best.json").write_text(json.dumps({"step": 20, "measure": "accuracy", "value": .7, "n": n}))


def test_the_doctor_names_the_peak_of_a_fall(tmp_path):
    kept = tmp_path / "kept"
    planted_history(kept, keep_best=True)
    d = diagnose_run(kept)
    assert not d.healthy
    first = d.prescriptions[0]
    assert first["priority"] == 1 and first["key"] == "eval.keep_best" and first["current"] is True
    assert first["action"].startswith("the best held-out evaluation was step 20 (accuracy 70.0% on 100 problems); "
                                      "the last, step 40: 30.0%")
    assert f"tether ppo --policy {kept / 'best' / 'model'}" in first["action"]
    assert [p["priority"] for p in d.prescriptions if not p["in_place"]] == list(
        range(1, 1 + sum(not p["in_place"] for p in d.prescriptions)))

    periodic = tmp_path / "periodic"  # no --keep-best, but a periodic checkpoint of step 20 survived
    planted_history(periodic, keep_best=False, checkpoint_steps=(20, 40))
    action = diagnose_run(periodic).prescriptions[0]["action"]
    assert "step 20" in action and f"A checkpoint of that step is on disk: {periodic / 'checkpoints' / 'step_000020'}" \
        in action
    assert diagnose_run(periodic).prescriptions[0]["suggestion"] == "true"

    gone = tmp_path / "gone"
    planted_history(gone, keep_best=False, checkpoint_steps=(30, 40))
    assert "No checkpoint of step 20 is on disk: rerun with --keep-best" in diagnose_run(gone).prescriptions[0]["action"]


def test_the_flag_the_yaml_key_and_trls_names():
    from tether.cli import build_parser
    from tether.config import config_from_dict, resolve_config
    from tether.errors import ConfigError
    from tether.ppo.config import RunConfig

    base = ["ppo", "--policy", "p", "--prompts", "x.jsonl", "--reward", "tether.rules:char_share"]
    assert resolve_config(RunConfig, build_parser("ppo").parse_args(base + ["--keep-best"])).eval.keep_best is True
    assert resolve_config(RunConfig, build_parser("ppo").parse_args(base)).eval.keep_best is False
    assert config_from_dict(RunConfig, {"eval": {"keep_best": True}}).eval.keep_best is True  # YAML's path
    with pytest.raises(ConfigError, match="load_best_model_at_end.*eval.keep_best"):
        RunConfig(load_best_model_at_end=True)
