"""The CLI as a product: one flag name per concept (old names hidden, deprecated, still working), help grouped by
concern with no internal spec codes, "did you mean" for unknown flags (TRL/OpenRLHF spellings too), --version, and
a PPO run that talks: a start-up summary, plain step lines off a terminal, one line per evaluation, an end line."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_report import make_run
from tiny import make_policy_dir, make_prompts_file

from tether.cli import build_parser, main, parse

REPO = Path(__file__).resolve().parents[1]
SPEC_CODE = re.compile(r"\([A-F]\d+|[(;,] ?[A-F]\d{1,2}\b[);,]|§|reference 000")


def parsed(argv: list[str]) -> dict:
    """The parsed flags of ``argv`` (the values before the config checks), as one dict."""
    args = vars(parse(build_parser(argv[0]), argv))
    return {k: v for k, v in args.items() if k != "help_all"}


# (command, old flag, current flag, value): every concept the table names, one name in every command
RENAMED = [
    ("ppo", "--model-dtype", "--dtype", "bf16"), ("sft", "--model-dtype", "--dtype", "bf16"),
    ("sample", "--model-dtype", "--dtype", "bf16"),
    ("ppo", "--model-lora-alpha", "--lora-alpha", "32"), ("sft", "--model-lora-alpha", "--lora-alpha", "32"),
    ("ppo", "--model-lora-target-modules", "--lora-target-modules", "q_proj,v_proj"),
    ("ppo", "--model-lora-target", "--lora-target-modules", "q_proj"),
    ("sft", "--model-lora-target-modules", "--lora-target-modules", "c_attn"),
    ("plan", "--lora-targets", "--lora-target-modules", "all"),
    ("ppo", "--optim-weight-decay", "--weight-decay", "0.1"), ("ppo", "--optim-max-grad-norm", "--max-grad-norm", "0.5"),
    ("ppo", "--optim-schedule", "--lr-scheduler", "cosine"), ("sft", "--lr-schedule", "--lr-scheduler", "cosine"),
    ("ppo", "--optim-warmup-steps", "--warmup-steps", "3"),
    ("ppo", "--data-eval-fraction", "--eval-fraction", "0.2"),
    ("sft", "--max-steps", "--steps", "7"),
    ("sft", "--optim-max-skipped-steps", "--max-skipped-steps", "5"),
    ("sample", "--generation-engine-tp", "--engine-tp", "1"),
    ("plan", "--response-length", "--max-new-tokens", "128"),
    ("ppo", "--target-kl", "--kl-target", "0.02"), ("ppo", "--ppo-target-kl", "--ppo-early-stop-kl", "0.03"),
    ("ppo", "--model-gradient-checkpointing", "--gradient-checkpointing", "true"),
]


@pytest.mark.parametrize("command,old,new,value", RENAMED)
def test_old_flag_still_works_with_one_deprecation_line(command, old, new, value, capsys):
    with_new = parsed([command, new, value])
    assert capsys.readouterr().err == ""
    with_old = parsed([command, old, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert with_old == with_new and value in with_new.values()
    assert len(err) == 1 and old in err[0] and f"use {new}" in err[0] and "deprecated" in err[0]


def test_old_names_are_hidden_and_the_new_ones_shared(capsys):
    """Each concept has the same flag in every command that has it; old names appear in no help."""
    shared = {"--dtype": ["ppo", "sft", "sample", "train-rm", "plan"],
              "--lora-alpha": ["ppo", "sft", "train-rm"], "--lora-target-modules": ["ppo", "sft", "train-rm", "plan"],
              "--weight-decay": ["ppo", "sft", "train-rm"], "--max-grad-norm": ["ppo", "sft", "train-rm"],
              "--lr-scheduler": ["ppo", "sft"], "--eval-fraction": ["ppo", "sft", "train-rm"],
              "--steps": ["ppo", "sft"], "--max-skipped-steps": ["ppo", "sft"], "--engine-tp": ["ppo", "sample", "plan"],
              "--max-new-tokens": ["ppo", "sft", "sample", "plan"]}
    for flag, commands in shared.items():
        for command in commands:
            with pytest.raises(SystemExit):
                main([command, "--help-all"])
            page = capsys.readouterr().out
            assert re.search(rf"^\s+{re.escape(flag)}\b", page, re.M), (command, flag)
            assert not any(re.search(rf"^\s+{re.escape(old)}\b", page, re.M)
                           for c, old, _, _ in RENAMED if c == command), command


def test_kl_target_and_early_stop_are_two_named_settings():
    args = parsed(["ppo", "--kl-target", "0.02", "--ppo-early-stop-kl", "0.5"])
    assert args["kl.target"] == "0.02" and args["ppo.target_kl"] == "0.5"


@pytest.mark.parametrize("argv,expected", [
    (["ppo", "--kl-cof", "0.1"], "did you mean --kl-coef"),
    (["ppo", "--learning_rate", "1e-5"], "--lr"),
    (["ppo", "--beta", "0.1"], "--kl-coef"),
    (["ppo", "--output_dir", "x"], "--output-dir"),
    (["ppo", "--model_name_or_path", "x"], "--policy"),
    (["sft", "--model_name_or_path", "x"], "--model"),
    (["ppo", "--num_generations", "4"], "--samples-per-prompt"),
    (["train-rm", "--per_device_train_batch_size", "4"], "--batch-size"),
    (["ppo", "--target_kl", "0.1"], "--ppo-early-stop-kl"),  # CleanRL's target_kl is the epoch early stop
    (["sft", "--max_grad_norm", "1"], "did you mean --max-grad-norm"),
    (["plan", "--bf16"], "--dtype bf16"),
    (["demo", "--quik"], "did you mean --quick"),
])
def test_unknown_flag_names_the_flag_meant(argv, expected, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"tether {argv[0]}: error: unrecognized argument {argv[1]}") and expected in err[0], err


def test_version(capsys):
    import tether

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tether {tether.__version__}"


def test_help_is_grouped_short_and_free_of_spec_codes(capsys):
    with pytest.raises(SystemExit):
        main(["ppo", "--help"])
    short = capsys.readouterr().out
    for title in ("model:", "data:", "generation:", "reward:", "KL:", "PPO:", "evaluation:"):
        assert re.search(rf"^{title}$", short, re.M), title
    assert "--help-all" in short and "--critic-lr" not in short
    with pytest.raises(SystemExit):
        main(["ppo", "--help-all"])
    full = capsys.readouterr().out
    for title in ("critic:", "optimiser:", "health:", "checkpoints:", "distributed:", "performance:"):
        assert re.search(rf"^{title}$", full, re.M), title
    flags = lambda page: set(re.findall(r"^\s+(--[a-z0-9-]+)", page, re.M))  # noqa: E731
    assert len(flags(short)) < 40 < 100 < len(flags(full)) and flags(short) < flags(full)
    for command in ("ppo", "sft", "sample", "train-rm", "plan", "label-steps", "doctor", "report", "demo"):
        with pytest.raises(SystemExit):
            main([command, "--help-all"])
        page = capsys.readouterr().out
        assert not SPEC_CODE.search(page), (command, SPEC_CODE.search(page))


def test_dry_run_checklist_has_no_spec_codes(tmp_path, capsys):
    root = tmp_path / "m"
    root.mkdir()
    policy, prompts = make_policy_dir(root), make_prompts_file(root)
    assert main(["ppo", "--policy", str(policy), "--prompts", str(prompts), "--reward", "tether.rules:char_share",
                 "--output-dir", str(tmp_path / "run"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "launch checklist" in out and not SPEC_CODE.search(out)


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson's interval, written out here: (p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)."""
    p = k / n
    mid, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (mid - half) / (1 + z * z / n), (mid + half) / (1 + z * z / n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("talk")
    return make_policy_dir(root), make_prompts_file(root)


def ppo_argv(tiny, out: Path, *extra: str) -> list[str]:
    policy, prompts = tiny
    return ["ppo", "--policy", str(policy), "--prompts", str(prompts), "--reward", "tether.rules:char_share",
            "--output-dir", str(out), "--batch-size", "4", "--mini-batches", "2", "--max-new-tokens", "5",
            "--eval-fraction", "0.25", "--eval-n", "8", "--gold", "tether.demo.task:gold_reward", *extra]


def test_a_run_off_a_terminal_prints_one_line_per_step_and_per_evaluation(tiny, tmp_path):
    """stderr to a pipe (a CI log): one plain line per step there and no carriage return; on stdout a start-up
    summary, one line per evaluation whose accuracy, Wilson interval and paired change since step 0 are those of
    metrics.jsonl, and the end line with the steps and the next commands."""
    out = tmp_path / "run"
    argv = ppo_argv(tiny, out, "--steps", "3", "--eval-every", "2", "--eval-at-start", "true")
    proc = subprocess.run([sys.executable, "-m", "tether", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "\r" not in proc.stderr and "\r" not in proc.stdout
    assert [int(m.group(1)) for line in proc.stderr.splitlines()
            if (m := re.match(r"ppo step (\d+)/3  score ", line))] == [1, 2, 3]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"tether ppo: 3 steps -> {out}"
    assert any(line.startswith("  prompts:  24 training; 8 held-out") for line in lines)
    assert any(line.startswith("  policy:   ") and "trainable" in line for line in lines)
    assert any(line.startswith("  rewards:  tether.rules:char_share; gold rule: tether.demo.task:gold_reward")
               for line in lines)
    rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    evals = [line for line in lines if line.startswith("eval step ")]
    assert [int(re.match(r"eval step (\d+)/3", e).group(1)) for e in evals] == [0, 2, 3]
    base = rows[0]["eval/correct"]
    for line in evals:
        row = rows[int(re.match(r"eval step (\d+)", line).group(1))]
        correct = row["eval/correct"]
        low, high = wilson(correct.count("1"), len(correct))
        assert (f"accuracy {100 * correct.count('1') / len(correct):.1f}% (95% CI {100 * low:.1f}-{100 * high:.1f}%, "
                f"n {len(correct)})") in line
        if row["step"]:
            gained = sum(a == "0" and b == "1" for a, b in zip(base, correct))
            lost = sum(a == "1" and b == "0" for a, b in zip(base, correct))
            assert f"{100 * (gained - lost) / len(correct):+.1f} points since step 0 ({gained} problems gained, " \
                   f"{lost} lost" in line
        assert f"reward {row['eval/reward']:.3f}" in line and "KL to the reference" in line
    assert lines[-2].startswith("tether ppo: 3 steps;")
    assert f"tether doctor {out}" in proc.stdout and f"tether report {out}" in proc.stdout


def test_progress_false_still_prints_the_summary_and_the_evaluations(tiny, tmp_path, capsys):
    out = tmp_path / "quiet"
    assert main(ppo_argv(tiny, out, "--steps", "2", "--eval-every", "1", "--eval-at-start", "false",
                         "--progress", "false")) == 0
    captured = capsys.readouterr()
    assert "ppo step" not in captured.err and "\r" not in captured.err
    assert captured.out.startswith("tether ppo: 2 steps ->")
    assert [line.split(":")[0] for line in captured.out.splitlines() if line.startswith("eval step")] == \
        ["eval step 1/2", "eval step 2/2"]
    assert "points since step 1" in captured.out  # no step-0 evaluation: the change is since the first one
    assert captured.out.splitlines()[-2].startswith("tether ppo: 2 steps;")


def test_doctor_and_report_count_steps_not_the_step_0_evaluation(tmp_path):
    """A 12-step run with a step-0 evaluation row is '12 steps', and its gold accuracy reads as a percentage."""
    from tether.diagnostics.doctor import diagnose_run
    from tether.diagnostics.report import write_report

    run = make_run(tmp_path, "twelve", 0.05, n=12)
    rows = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/reward": 0.0, "eval/accuracy": 0.35}) + "\n" + rows)
    assert diagnose_run(run).n_steps == 12
    page = write_report([run], tmp_path / "report.html").read_text(encoding="utf-8")
    assert "(12 steps, " in page and "<tr><td>steps</td><td>12</td></tr>" in page
    assert "<tr><td>last gold accuracy</td><td>60.0%</td></tr>" in page


def test_every_foreign_spelling_points_at_a_flag_that_exists():
    """Each TRL/OpenRLHF/CleanRL spelling in the table names a flag some command has (a rename would orphan it)."""
    from tether.cli_flags import FOREIGN

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices.values()
    known = {o for c in commands for o in c._option_string_actions}
    missing = {name: targets for name, targets in FOREIGN.items()
               if not any(t.split()[0] in known for t in targets)}
    assert not missing
