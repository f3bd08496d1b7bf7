"""`tether ppo` end to end: the CLI, bad input (one line, exit code 2), two processes with DDP."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launcher import accelerate_launch
from tiny import make_policy_dir, make_prompts_file

from tether.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo_cli")
    return make_policy_dir(root), make_prompts_file(root)


def base_args(files, out):
    policy, prompts = files
    return ["ppo", "--policy", str(policy), "--prompts", str(prompts), "--reward", "tether.rules:char_share",
            "--output-dir", str(out), "--steps", "2", "--batch-size", "4", "--mini-batches", "2",
            "--max-new-tokens", "5", "--progress", "false",
            "--eval-at-start", "false"]  # no step-0 row: one metrics row per step (held-out evaluation is on)


def test_cli_end_to_end_and_yaml(files, tmp_path, capsys):
    config = tmp_path / "ppo.yaml"
    config.write_text("kl:\n  coef: 0.1\n  controller: adaptive\nppo:\n  epochs: 2\n  target_kl: 0.5\n"
                      "eval:\n  every: 1\n  n: 4\n  at_start: false\ndata:\n  eval_fraction: 0.25\n"
                      "reward:\n  gold: tether.demo.task:gold_reward\n")
    out = tmp_path / "run"
    assert main(base_args(files, out) + ["--config", str(config), "--steps", "3", "--ppo-target-kl", "0.02"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    required = ["objective/scores", "objective/rlhf_reward", "objective/kl", "objective/kl_max", "objective/kl_p99",
                "objective/kl_coef",
                "policy/loss", "policy/clip_fraction", "policy/approx_kl", "policy/ratio_mean", "policy/ratio_std",
                "policy/ratio_max", "policy/entropy", "value/loss", "value/clip_fraction",
                "value/explained_variance", "value/mean", "response/length_mean", "response/truncated_fraction",
                "response/repetition", "perf/seconds_generate", "perf/seconds_score", "perf/seconds_train",
                "perf/seconds_weight_sync", "perf/seconds_logprobs_old", "perf/seconds_reference",
                "perf/seconds_values", "perf/seconds_reward",
                "perf/tokens_per_second", "perf/rollout_share", "ppo/epochs_run", "eval/reward", "eval/accuracy"]
    for key in required:
        assert key in rows[-1], key
    assert rows[-1]["perf/seconds_weight_sync"] == 0.0  # the transformers engine samples the trained weights
    parts = ("logprobs_old", "reference", "values", "reward")
    assert rows[-1]["perf/seconds_score"] == pytest.approx(sum(rows[-1][f"perf/seconds_{k}"] for k in parts))
    assert rows[0]["objective/kl_coef"] == 0.1 and rows[-1]["ppo/epochs_run"] <= 2
    # The adaptive rule (B11), from the KL step 2 saw against target 0.01: x2 above 1.5 x target, /2 below
    # target / 1.5, unchanged between. Step 1 sampled from the reference itself (KL exactly 0): β kept.
    assert rows[0]["objective/kl"] == 0.0 and rows[1]["objective/kl_coef"] == 0.1
    kl_seen = rows[1]["objective/kl"]
    expected_beta = 0.2 if kl_seen > 0.015 else 0.05 if kl_seen < 0.01 / 1.5 else 0.1
    assert rows[2]["objective/kl_coef"] == pytest.approx(expected_beta, rel=1e-12)
    assert all(r["objective/kl_p99"] <= r["objective/kl_max"] for r in rows)  # a percentile, not above the max
    saved = (out / "config.yaml").read_text()
    assert "controller: adaptive" in saved and "target_kl: 0.02" in saved  # the flag over the YAML key
    samples = [json.loads(line) for line in (out / "samples" / "step_3.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "response", "score", "kl", "length", "truncated", "correct"} <= samples[0].keys()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "policy")  # the final policy is a plain HF directory
    # Running again into the same directory without --resume leaves the run intact.
    before = (out / "metrics.jsonl").read_text()
    assert main(base_args(files, out)) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == before


def run_cli(args):
    proc = subprocess.run([sys.executable, "-m", "tether", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    return proc.returncode, proc.stderr.strip().splitlines()


@pytest.mark.parametrize("change,expected", [
    ({"--prompts": "missing.jsonl"}, "missing.jsonl"),
    ({"--prompts": "EMPTY"}, "no prompts"),
    ({"--reward": "tether.rules:no_such_rule"}, "has no function 'no_such_rule'"),
    ({"--reward": "no_such_module_xyz:f"}, "cannot import module 'no_such_module_xyz'"),
    ({"--reward": "NOT_A_RM"}, "tether_reward.json"),
    ({"--mini-batches": "3"}, "--mini-batches: 3 does not divide --batch-size 4"),
    ({"--kl-controller": "pid"}, "'pid' is not one of fixed, adaptive, proportional"),
    ({"--kl-coef": "abc"}, "--kl-coef: expected a number, got 'abc'"),
    ({"--steps": "0"}, "--steps: must be >= 1"),
    ({"--ppo-early-stop-kl": "0"}, "--ppo-early-stop-kl: must be > 0.0, got 0.0"),  # off is --ppo-early-stop false
    ({"--no-such-flag": "1"}, "unrecognized argument --no-such-flag"),
    ({"--log-with": "nosuch"}, "--log-with: 'nosuch' is not a tracker accelerate knows"),
    ({"--critic-lora-r": "4"}, "--critic-lora-r: needs --critic separate"),
    ({"--top-p": "0.9"}, "--top-p: 0.9 refused; PPO's log-probs, ratio and KL are of the untruncated"),
    ({"--top-k": "20"}, "--top-k: 20 refused"),
    ({"--engine": "sglang"}, "--engine: 'sglang' is not one of transformers, vllm"),
])
def test_bad_input_one_line_exit_2(files, tmp_path, change, expected):
    (tmp_path / "empty.jsonl").write_text("")
    not_rm = tmp_path / "not_rm"
    not_rm.mkdir()
    (not_rm / "config.json").write_text("{}")
    args = base_args(files, tmp_path / "run")
    for flag, value in change.items():
        value = {"EMPTY": str(tmp_path / "empty.jsonl"), "NOT_A_RM": str(not_rm)}.get(value, value)
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    code, err = run_cli(args)
    assert code == 2, err
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_bad_yaml_key(files, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("kl:\n  coeff: 0.1\n")
    code, err = run_cli(base_args(files, tmp_path / "run") + ["--config", str(config)])
    assert code == 2 and len(err) == 1 and "unknown key 'kl.coeff'" in err[0], err


@pytest.mark.slow
def test_two_processes_ddp_ranks_hold_equal_weights(files, tmp_path):
    out = tmp_path / "ddp"
    _launch_two([*base_args(files, out), "--grad-accumulation", "2"], tmp_path / "logs")
    ranks = json.loads((out / "ranks.json").read_text())
    assert ranks["world_size"] == 2 and ranks["in_sync"] is True
    assert ranks["digests"][0] == ranks["digests"][1]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2  # one row per step, written once


def test_metrics_reach_the_tensorboard_tracker(files, tmp_path):
    """--log-with tensorboard goes through accelerate's tracker: every step's scalars in the event file equal
    the metrics.jsonl row (written once, by the main process)."""
    pytest.importorskip("tensorboard", reason="pip install tensorboard (the [test] extra has it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert main(base_args(files, out) + ["--log-with", "tensorboard", "--tracker-project", "tb"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    for key in ("objective/kl", "objective/scores", "policy/loss", "value/loss"):
        logged = {e.step: e.value for e in events.Scalars(key)}
        assert logged == pytest.approx({r["step"]: r[key] for r in rows}, rel=1e-6), key


def test_an_error_exit_of_a_launched_process_still_finishes_the_trackers(files, tmp_path):
    """Issue #42: a process of `accelerate launch` ends with os._exit (tether.cli.main under WORLD_SIZE > 1), which
    runs no atexit handler, so a run that stops with an error must finish its trackers itself: W&B marks an
    unfinished run crashed, MLflow leaves it RUNNING. (accelerate's TensorBoard tracker flushes every log, so its
    scalars are there either way.) The child does what cli.main does there, with the tracker's finish() recorded."""
    pytest.importorskip("tensorboard", reason="pip install tensorboard (the [test] extra has it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, finished = tmp_path / "run", tmp_path / "finished"
    args = base_args(files, out) + ["--reward", "bad_rules:fails_from_step_2", "--steps", "3", "--log-with",
                                    "tensorboard", "--tracker-project", "tb", "--eval-every", "0"]  # calls: steps
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from pathlib import Path\n"
            "from accelerate.tracking import TensorBoardTracker\n"
            "finish = TensorBoardTracker.finish\n"
            "def recorded(self):\n    Path(sys.argv[1]).write_text('finished'); finish(self)\n"
            "TensorBoardTracker.finish = recorded\n"
            "from tether.cli import main; from tether.ppo.processes import leave_without_teardown\n"
            "leave_without_teardown(main(sys.argv[3:]))")
    done = subprocess.run([sys.executable, "-c", code, str(finished), str(Path(__file__).parent), *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "rule fails_from_step_2: raised on every response" in done.stderr, done.stderr
    assert finished.is_file()  # the tracker was finished before os._exit
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("objective/kl")} == pytest.approx({1: rows[0]["objective/kl"]})


def _launch_two(args, log_dir, timeout=600):
    """``accelerate launch`` of ``tether ARGS`` on 2 CPU processes (tests/launcher.py: a free port; a failure
    or a timeout raises with each process's own stderr, from its log under ``log_dir``)."""
    return accelerate_launch(["-m", "tether", *args], log_dir, timeout=timeout)


@pytest.mark.slow
def test_two_processes_with_a_tracker_finish_their_last_collectives(files, tmp_path):
    """With a tracker on, the main process finishes it after the last step and still compares the ranks'
    weights with the other process afterwards: the process group outlives the tracker."""
    pytest.importorskip("tensorboard", reason="pip install tensorboard (the [test] extra has it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    _launch_two([*base_args(files, out), "--log-with", "tensorboard", "--tracker-project", "tb"], tmp_path / "logs")
    assert json.loads((out / "ranks.json").read_text())["in_sync"] is True
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("objective/kl")] == [1, 2]  # logged once, by the main process


@pytest.mark.slow
def test_two_processes_resume_equals_the_straight_run(files, tmp_path):
    """Stopped at step 2 and resumed to 4 equals the straight 4-step run, with 2 processes: every process's
    RNG state is saved and restored (each samples its own responses), running reward normalisation is over
    both processes' rows."""
    from safetensors.torch import load_file

    extra = ["--save-every", "2", "--reward-normalize", "running", "--lora-r", "4"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    _launch_two([*base_args(files, straight), "--steps", "4", *extra], tmp_path / "logs_straight")
    _launch_two([*base_args(files, split), "--steps", "2", *extra], tmp_path / "logs_split")
    _launch_two([*base_args(files, split), "--steps", "4", *extra, "--resume"], tmp_path / "logs_resume")

    def rows(run):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
                for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert [r["step"] for r in rows(split)] == [1, 2, 3, 4] and rows(split) == rows(straight)
    a = load_file(str(straight / "policy" / "model.safetensors"))
    b = load_file(str(split / "policy" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((split / "ranks.json").read_text())["in_sync"] is True


@pytest.mark.slow
def test_an_alarm_seen_by_the_main_process_stops_every_process(files, tmp_path):
    """Evaluation (and so the gold-drop band) exists on the main process only: its stop decision must reach
    the other process, which would otherwise wait in the next step's collectives for ever."""
    out = tmp_path / "run"
    off = [a for band in ("ratio_std", "clip_fraction", "kl_mean", "kl_max", "value_loss", "explained_variance",
                          "entropy", "length_collapse", "length_surge", "not_learning")
           for a in ("--health-band", f"{band}=off")]
    # 16 held-out problems, all right at step 1 and wrong at step 2: a paired fall with p = 2^-16 (z = 4.2)
    args = [*base_args(files, out), "--steps", "8", "--gold", "alarm_rules:right_once", "--eval-every", "1",
            "--eval-n", "16", "--data-eval-fraction", "0.5", "--stop-on-alarm", "true", "--health-persistence", "1",
            *off]
    args[args.index("tether.rules:char_share")] = "alarm_rules:rising"
    _launch_two(args, tmp_path / "logs", timeout=240)  # a hang fails here, its processes stopped
    alerts = [json.loads(line) for line in (out / "alerts.jsonl").read_text().splitlines()]
    assert len(alerts) == 1 and "eval/accuracy" in alerts[0]["alert"] and alerts[0]["step"] == 2
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.slow
def test_rollback_on_a_paired_gold_fall_restores_the_last_checkpoint_before_it(files, tmp_path):
    """The live monitor reads each evaluation's per-problem results (eval/correct): the 16 held-out problems
    all right at steps 1 and 2 and all wrong from step 3 while the reward rises is a paired fall, in alarm at
    step 3 (16 right -> wrong against step 2, p = 2^-16, x2 earlier evaluations: z = 4.0) and confirmed at
    step 4 (the default persistence). --rollback-on-alarm stops there and restores step_2, the newest
    checkpoint saved before the fall's onset (step_3 was saved in the fall, before its confirmation)."""
    import alarm_rules
    from safetensors.torch import load_file

    alarm_rules.reset()
    out = tmp_path / "run"
    args = [*base_args(files, out), "--steps", "6", "--gold", "alarm_rules:right_twice", "--eval-every", "1",
            "--eval-n", "16", "--eval-samples", "2", "--data-eval-fraction", "0.5", "--save-every", "1",
            "--keep-checkpoints", "6", "--rollback-on-alarm", "true"]
    args[args.index("tether.rules:char_share")] = "alarm_rules:rising"
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval/correct"]) for r in rows] == [(1, "1" * 16), (2, "1" * 16), (3, "0" * 16),
                                                              (4, "0" * 16)]
    assert len((out / "samples" / "step_4.jsonl").read_text().splitlines()) == 2  # eval.samples: the record has all
    (alert,) = [json.loads(line) for line in (out / "alerts.jsonl").read_text().splitlines()]
    assert alert["step"] == 4 and "since step 3" in alert["alert"] and "16 right -> wrong" in alert["alert"]
    policy = load_file(str(out / "policy" / "model.safetensors"))
    saved = {k: load_file(str(out / "checkpoints" / f"step_{k:06d}" / "policy" / "model.safetensors")) for k in (2, 4)}
    assert any(not torch.equal(saved[2][k], saved[4][k]) for k in policy)  # the steps changed the weights
    assert all(torch.equal(policy[k], saved[2][k]) for k in policy)


def test_dry_run_prints_the_plan_and_the_checklist_and_trains_nothing(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(base_args(files, out) + ["--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "peak:" in printed and "FITS" in printed and "launch checklist" in printed
    assert not out.exists()  # nothing written, nothing trained
    for item in ("KL penalty", "held-out evaluation"):  # the defaults are what the checklist recommends (#49)
        assert next(x for x in printed.splitlines() if item in x).lstrip().startswith("ok"), item
    assert main(base_args(files, out) + ["--dry-run", "--kl-coef", "0", "--eval-fraction", "0"]) == 0
    printed = capsys.readouterr().out
    for item in ("KL penalty", "held-out evaluation"):  # no tether, nothing held out: flagged
        assert next(x for x in printed.splitlines() if item in x).lstrip().startswith("--"), item


@pytest.mark.parametrize("world_size", ["1", "2"])
@pytest.mark.parametrize("outcome", ["ok", "bad input"])
def test_a_launched_process_ends_without_the_interpreter_teardown(files, tmp_path, world_size, outcome):
    """#32: under DDP/FSDP2 gloo's threads outlive destroy_process_group, and the interpreter's teardown with them
    running can abort a process whose run succeeded. A `tether ppo` process of a launch (WORLD_SIZE > 1) ends with
    os._exit after its output is flushed: an atexit handler (the teardown) never runs, its exit status and its
    printed lines are the same as without it. A plain process (WORLD_SIZE 1) keeps the normal exit."""
    args = base_args(files, tmp_path / "run") + (["--dry-run"] if outcome == "ok" else ["--log-with", "nosuch"])
    code = ("import atexit, sys; atexit.register(lambda: print('TEARDOWN', flush=True)); "
            "from tether.cli import main; sys.exit(main(sys.argv[1:]))")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          env={**env, "WORLD_SIZE": world_size}, timeout=300)
    if outcome == "ok":
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "peak:" in proc.stdout and "launch checklist" in proc.stdout  # printed before os._exit: flushed
    else:
        assert proc.returncode == 2 and "--log-with: 'nosuch'" in proc.stderr, proc.stderr[-2000:]
    assert ("TEARDOWN" in proc.stdout) == (world_size == "1")


def test_kl_k3_clip_is_a_flag_defaulting_to_the_peers_10(files, tmp_path, capsys):
    from tether.cli import build_parser
    from tether.config import resolve_config
    from tether.ppo.config import RunConfig

    assert RunConfig().kl.k3_clip == 10.0
    args = build_parser("ppo").parse_args(base_args(files, tmp_path / "run") + ["--kl-k3-clip", "0"])
    assert resolve_config(RunConfig, args).kl.k3_clip == 0.0
    assert main(base_args(files, tmp_path / "bad") + ["--kl-k3-clip", "-1"]) == 2
    assert "--kl-k3-clip" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()

