"""The Python trainers (issue 30): one validation path with the CLI, ``PPOTrainer.step()`` and ``train()``, rewards
as Python objects with the names the config records (and the resume that needs them again), callbacks that add
metrics and stop the run, and a stopped run that resumes to the straight run's numbers."""

import json
import math
from pathlib import Path

import pytest
import torch
from tiny import make_policy_dir, make_prompts_file, tiny_config

import tether
from tether.cli import main
from tether.errors import ConfigError, TetherError
from tether.ppo.config import RunConfig
from tether.rm.config import RewardTrainingConfig


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainers")
    return make_policy_dir(root), make_prompts_file(root)


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without(rows_, *prefixes):
    return [{k: v for k, v in r.items() if not k.startswith(prefixes)} for r in rows_]


def cli_error(args, capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err.split(": error: ", 1)[1]


# ------------------------------------------------------------------------------------- one validation path
@pytest.mark.parametrize("key, value, flag", [
    ("reward.normalize", "Batch", "--reward-normalize"),  # before: silently no normalisation
    ("generation.top_p", 0.9, "--top-p"),                  # before: silently ignored
    ("ppo.mini_batches", 3, "--mini-batches"),             # before: silently another update count
])
def test_a_bad_value_from_python_is_the_same_one_line_error_as_the_flag(key, value, flag, files, tmp_path, capsys):
    policy, prompts = files
    expected = cli_error(["ppo", "--policy", str(policy), "--prompts", str(prompts), "--reward", "tether.rules:x",
                          "--batch-size", "8", "--output-dir", str(tmp_path / "cli"), flag, str(value)], capsys)
    assert expected.startswith(flag + ":")
    # a field's own check names the key set from Python and its flag (#49); a cross-field check names the flags
    if key == "reward.normalize":  # (top_p < 1 and the mini-batch count are refused by cross-field checks)
        expected = f"{key} ({flag})" + expected[len(flag):]
    cfg = tiny_config(tmp_path, policy, prompts)
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError) as raised:
        tether.PPOTrainer(cfg)
    assert str(raised.value) == expected
    with pytest.raises(ConfigError, match=flag):  # the run loop's own entry checks too (the demo calls it)
        from tether.ppo.train import train

        train(cfg)
    with pytest.raises(ConfigError) as raised:  # a dict of keys, as a notebook writes it
        tether.PPOTrainer({"model.policy": str(policy), "data.prompts": str(prompts), "output_dir": str(tmp_path / "d"),
                           "reward.sources": ["tether.rules:x"], "batch_size": 8, key: value})
    assert str(raised.value) == expected
    assert not (tmp_path / "run").exists() and not (tmp_path / "d").exists()  # nothing written


def test_reward_training_config_from_python_is_checked_as_flags_are(tmp_path, capsys):
    expected = cli_error(["train-rm", "--model", "m", "--data", "d.jsonl", "--output-dir", str(tmp_path / "o"),
                          "--format", "Chat"], capsys)
    cfg = RewardTrainingConfig(model="m", output_dir=str(tmp_path / "o"))
    cfg.data.files, cfg.data.format = ["d.jsonl"], "Chat"
    with pytest.raises(ConfigError) as raised:
        tether.RewardTrainer(cfg)
    assert expected == "--format: 'Chat' is not one of auto, chat, plain"
    assert str(raised.value) == "data.format (--format): 'Chat' is not one of auto, chat, plain"  # the key set


# ---------------------------------------------------------------------------------- step(), train(), rewards
def no_rewards(cfg):
    cfg.reward.sources = []
    return cfg


def test_step_by_step_with_a_closure_reward_then_train_to_the_end(files, tmp_path):
    seen = []

    def half(prompts, responses, ended_with_eos, **columns):  # a closure: the rule signature, any state
        seen.append((len(responses), sorted(columns)))
        return [0.5] * len(responses)

    cfg = no_rewards(tiny_config(tmp_path, *files, steps=3))
    trainer = tether.PPOTrainer(cfg, reward=half)
    record = trainer.step()
    assert isinstance(record, tether.StepRecord) and record.step == 1 and trainer.steps_done == 1
    assert record.metrics["objective/scores_raw"] == 0.5 and seen[-1] == (8, ["answer"])
    written = rows(tmp_path / "run")
    assert len(written) == 1 and written[0].keys() == record.metrics.keys()  # the row as written
    assert written[0]["objective/kl"] == record.metrics["objective/kl"]
    result = trainer.train()
    assert isinstance(result, tether.TrainResult) and result.steps == 3 and result.stopped is None
    assert result.run_dir == tmp_path / "run" and (result.models["policy"] / "model.safetensors").is_file()
    assert [r["step"] for r in rows(result.run_dir)] == [1, 2, 3] and result.metrics["step"] == 3
    saved = (result.run_dir / "config.yaml").read_text()
    assert "python:half" in saved and cfg.reward.sources == []  # the caller's config is left as it was
    with pytest.raises(TetherError, match="the run is finished"):
        trainer.step()


def test_a_python_reward_must_be_given_again_to_resume(files, tmp_path, capsys):
    cfg = tiny_config(tmp_path, *files, steps=2, save_every=1, reward__sources=["tether.rules:char_share:char=7"])
    tether.PPOTrainer(cfg, reward={"half": lambda prompts, responses, **_: [0.5] * len(responses)}).train()
    saved = tmp_path / "run" / "config.yaml"
    refusal = "--reward python:half: this run's reward 'half' was a Python object; resume it from Python, giving it"
    assert cli_error(["ppo", "--config", str(saved), "--resume", "--steps", "3"], capsys).startswith(refusal)
    with pytest.raises(TetherError, match=refusal):  # from Python, under another name
        tether.PPOTrainer(saved, reward={"other": lambda p, r, **_: [0.0] * len(r)}, resume=True)
    with pytest.raises(TetherError, match=r"--resume: reward.sources is \['tether.rules:char_share:char=7', "
                                          r"'python:other'\] but the run"):
        tether.PPOTrainer(cfg, reward={"other": lambda p, r, **_: [0.0] * len(r)}, resume=True)
    result = tether.PPOTrainer({**yaml_dict(saved), "steps": 3}, reward={"half": lambda p, r, **_: [0.5] * len(r)},
                               resume=True).train()
    assert [r["step"] for r in rows(result.run_dir)] == [1, 2, 3]


def yaml_dict(path):
    import yaml

    return yaml.safe_load(path.read_text())


def test_an_importable_function_is_recorded_as_its_spec_and_resumes_from_the_cli(files, tmp_path):
    from tether.rules import char_share

    cfg = no_rewards(tiny_config(tmp_path, *files, steps=1, save_every=1))
    tether.PPOTrainer(cfg, reward=char_share).train()
    saved = tmp_path / "run" / "config.yaml"
    assert yaml_dict(saved)["reward"]["sources"] == ["tether.rules:char_share"]
    assert main(["ppo", "--config", str(saved), "--resume", "--steps", "2"]) == 0
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2]


def test_reward_model_objects_join_the_ensemble_and_bad_rewards_are_one_line(files, tmp_path):
    from test_reward_model import load_rm, save_tiny_gpt2

    from tether.ppo.sources import RewardModelSource, build_sources

    load_rm(save_tiny_gpt2(tmp_path / "a", seed=0)).save_pretrained(tmp_path / "rm")
    in_memory = load_rm(save_tiny_gpt2(tmp_path / "b", seed=1))
    sources = build_sources(["python:rm", str(tmp_path / "rm")], given={"python:rm": in_memory}, device="cpu")
    assert len(sources) == 1 and isinstance(sources[0], RewardModelSource)  # one ensemble (mean), as two dirs
    prompts, responses = ["12+34=", "1+1="], ["640", "2"]
    from_dir = tether.RewardModel.from_pretrained(tmp_path / "rm", device="cpu").score(prompts, responses)
    expected = (from_dir + in_memory.score(prompts, responses)) / 2
    assert not torch.allclose(from_dir, expected)
    assert torch.allclose(sources[0](prompts, responses, {}), expected)
    # A process reward model object is a source of its own, read as its directory would be.
    from test_process_reward import _random_prm

    from tether.ppo.sources import ProcessRewardSource

    prm_dir = _random_prm(tmp_path)[0]
    prm = tether.ProcessRewardModel.from_pretrained(prm_dir, device="cpu")
    given, loaded = build_sources(["python:prm"], given={"python:prm": prm}, process="min")[0], \
        build_sources([str(prm_dir)], device="cpu", process="min")[0]
    assert isinstance(given, ProcessRewardSource) and given.prm is prm
    steps = ["12 34 5", "1 x"]
    assert torch.equal(given(prompts, steps, {}), loaded(prompts, steps, {}))
    cfg = tiny_config(tmp_path, *files)
    with pytest.raises(TetherError, match=r"--reward python:int: a int is not a reward"):
        tether.PPOTrainer(cfg, reward={"int": 3})


# ------------------------------------------------------------------------------------------------ callbacks
class StopAt(tether.Callback):
    """Adds a metric to every row, records every event, and stops the run after step ``at``."""

    def __init__(self, at=None):
        self.at, self.events = at, []

    def on_step_end(self, record):
        self.events.append(("step", record.step))
        if record.step == self.at:
            raise tether.StopTraining(f"enough at {record.step}")
        return {"custom/twice_step": 2.0 * record.step}

    def on_evaluate(self, metrics):
        self.events.append(("evaluate", sorted(metrics)))
        return {"custom/eval_seen": 1}

    def on_save(self, path):
        self.events.append(("save", path.name))

    def on_alert(self, alert):
        self.events.append(("alert", str(alert)))


def test_a_callback_stops_the_run_which_then_resumes_to_the_straight_runs_numbers(files, tmp_path):
    pytest.importorskip("tensorboard", reason="pip install tensorboard (the [test] extra has it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = dict(steps=4, eval__every=2, eval__n=4, data__eval_fraction=0.25, reward__normalize="running",
                    log_with=["tensorboard"], tracker_project="tb")
    straight = tether.PPOTrainer(tiny_config(tmp_path / "a", *files, **settings), callbacks=StopAt()).train()

    callback = StopAt(at=2)
    cfg = tiny_config(tmp_path / "b", *files, **settings)
    stopped = tether.PPOTrainer(cfg, callbacks=[callback]).train()
    run = stopped.run_dir
    assert stopped.stopped == "enough at 2" and stopped.steps == 2
    assert [e if e[0] != "evaluate" else e[0] for e in callback.events] == [
        ("step", 1), "evaluate", ("step", 2), ("save", "step_000002"), ("save", "policy")]
    assert {"eval/reward", "eval/n"} <= set(callback.events[1][1])
    # What the stopped run left: its rows (the callbacks' metrics in them), a checkpoint at the stop, the policy.
    assert [r["step"] for r in rows(run)] == [1, 2]
    assert rows(run)[0]["custom/twice_step"] == 2.0 and "custom/twice_step" not in rows(run)[1]  # it stopped
    assert rows(run)[1]["custom/eval_seen"] == 1 and rows(run)[1]["eval/n"] == 4
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]
    assert (run / "policy" / "model.safetensors").is_file() and (run / "samples" / "step_2.jsonl").is_file()
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("custom/twice_step")] == [(1, 2.0)]
    with pytest.raises(TetherError, match="already holds a run; use --resume"):
        tether.PPOTrainer(cfg)

    resumed = tether.PPOTrainer(cfg, callbacks=StopAt(), resume=True).train()
    assert resumed.steps == 4 and resumed.stopped is None
    # The stopped step's row lacks the metric its callback would have returned; every other number is the same.
    assert without(rows(run), "perf/", "custom/") == without(rows(straight.run_dir), "perf/", "custom/")
    from safetensors.torch import load_file

    a, b = (load_file(str(r / "policy" / "model.safetensors")) for r in (straight.run_dir, run))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dropped_rows_reach_on_alert_and_bad_callback_metrics_are_one_line(files, tmp_path):
    def nan_first(prompts, responses, **_):
        return [math.nan] + [0.5] * (len(responses) - 1)

    callback = StopAt()
    tether.PPOTrainer(no_rewards(tiny_config(tmp_path / "a", *files, steps=1)), reward=nan_first,
                      callbacks=callback).train()
    alerts = [e[1] for e in callback.events if e[0] == "alert"]
    assert len(alerts) == 1 and alerts[0].startswith("dropped 1 of 8 rows from the update (row 0: non-finite score")

    class Clash(tether.Callback):
        def on_step_end(self, record):
            return {"objective/kl": 0.0}

    with pytest.raises(TetherError, match=r"Clash.on_step_end: metric 'objective/kl' is already in the step's row"):
        tether.PPOTrainer(tiny_config(tmp_path / "b", *files, steps=1), callbacks=Clash()).train()
    with pytest.raises(TetherError, match="has none of the methods on_step_end"):
        tether.PPOTrainer(tiny_config(tmp_path / "c", *files), callbacks=[object()])


def test_runconfig_is_exported_and_import_stays_light():
    import subprocess
    import sys

    code = "import sys, tether; tether.Callback; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False" and tether.RunConfig is RunConfig


def test_dir_lists_the_lazy_names_without_importing_them():
    """Issue #42: tab completion (IPython, Jupyter, rlcompleter) offers what dir(tether) lists; the trainers are
    resolved lazily, so the module's __dir__ must name them — and listing them imports nothing heavy."""
    import subprocess
    import sys

    code = ("import sys, tether; names = dir(tether); print(sorted(set(tether.__all__) - set(names)), "
            "'PPOTrainer' in names, 'transformers' in sys.modules, names == sorted(names))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "True", "False", "True"]
    assert {"PPOTrainer", "RewardTrainer", "RunConfig", "RewardModel", "Callback", "gae", "__version__"} <= set(
        dir(tether))


@pytest.mark.slow
def test_under_two_processes_the_main_process_callback_stops_every_process(files, tmp_path):
    from launcher import accelerate_launch

    accelerate_launch([str(Path(__file__).parent / "trainer_worker.py"), *map(str, files), str(tmp_path)],
                      tmp_path / "logs", timeout=900)
    run = tmp_path / "run"
    assert [r["step"] for r in rows(run)] == [1, 2] and rows(run)[0]["custom/rank_seen"] == 0.0
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]
    assert json.loads((run / "ranks.json").read_text())["in_sync"] is True
    assert (run / "policy" / "model.safetensors").is_file()


def test_a_python_gold_rule_scores_eval_accuracy_and_is_needed_again_to_resume(files, tmp_path, capsys):
    """``gold=`` takes a callable with a rule's signature: it decides eval/accuracy (every held-out response it
    marks, in eval/correct and the samples), config.yaml records it as ``python:NAME``, and a resume needs it
    again (the command line refuses in one line, as for a Python reward)."""
    def even_length(prompts, responses, **columns):
        return [float(len(r) % 2 == 0) for r in responses]

    cfg = tiny_config(tmp_path, *files, steps=1, save_every=1, eval__every=1, eval__n=8, eval__samples=8,
                      data__eval_fraction=0.25)
    run_dir = tether.PPOTrainer(cfg, gold=even_length).train().run_dir
    row = rows(run_dir)[-1]
    samples = [json.loads(line) for line in (run_dir / "samples" / "step_1.jsonl").read_text().splitlines()]
    marks = [len(s["response"]) % 2 == 0 for s in samples]
    assert len(samples) == row["eval/n"] == 8 and [s["correct"] for s in samples] == marks
    assert row["eval/accuracy"] == sum(marks) / 8 and row["eval/correct"] == "".join(str(int(m)) for m in marks)
    saved = run_dir / "config.yaml"
    assert yaml_dict(saved)["reward"]["gold"] == "python:even_length"
    refusal = "--gold python:even_length: this run's gold rule was a Python function; resume it from Python"
    assert cli_error(["ppo", "--config", str(saved), "--resume", "--steps", "2"], capsys).startswith(refusal)
    result = tether.PPOTrainer({**yaml_dict(saved), "steps": 2}, gold=even_length, resume=True).train()
    assert [r["step"] for r in rows(result.run_dir)] == [1, 2]
    with pytest.raises(ConfigError, match="gold: a rule spec or a callable"):
        tether.PPOTrainer(cfg, gold=3)
