"""`tether sft` from the command line: --help, YAML + flags, bad input (one line, exit 2, nothing written), and the
three-stage pipeline on a tiny model — the SFT output used as it is by `tether train-rm --model` and `tether ppo
--policy`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_sft import rows_file
from tiny import make_policy_dir

from tether.cli import main


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_cli")
    return make_policy_dir(root), rows_file(root)


def sft_args(files, out, *extra):
    model, data = files
    return ["sft", "--model", str(model), "--data", str(data), "--output-dir", str(out), "--max-steps", "3",
            "--batch-size", "4", "--lr", "3e-3", "--progress", "false", *extra]


@pytest.mark.parametrize("command, flags", [("sft", ["--packing", "--export-lora", "--system-prompt", "--resume",
                                                     "--eval-prompts", "--gold", "--grad-accumulation"]),
                                            ("sample", ["--samples-per-prompt", "--reward", "--min-score", "--keep",
                                                        "--prompt-template", "--engine", "--format"])])
def test_help_lists_the_flags(command, flags, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help-all"])  # every flag; --help shows the common ones
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in flags)


def test_yaml_config_with_flags_over_it(files, tmp_path, capsys):
    config = tmp_path / "sft.yaml"
    config.write_text("optim:\n  lr: 0.01\n  max_steps: 5\ndata:\n  eval_fraction: 0.25\neval:\n  gold: none\n")
    out = tmp_path / "out"
    assert main(sft_args(files, out, "--config", str(config), "--max-steps", "2")) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["optim"]["lr"] == 3e-3 and saved["optim"]["max_steps"] == 2 and saved["data"]["eval_fraction"] == 0.25
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "eval/loss" in rows[-1]
    assert "the policy is" in capsys.readouterr().out


@pytest.mark.parametrize("name, change, expected", [
    ("bad row", lambda d: d.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2="}\n'),
     "{data}: line 2: expected 'messages', 'prompt' + 'completion'"),
    ("missing file", lambda d: d.unlink(), "{data}: file not found"),
    ("bad flag", None, "--lr: must be > 0.0, got -1.0"),
    ("export without lora", None, "--export-lora adapter: needs --lora-r > 0"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(files, tmp_path, capsys, name, change, expected):
    model, _ = files
    data = rows_file(tmp_path)
    extra = {"bad flag": ["--lr", "-1"], "export without lora": ["--export-lora", "adapter"]}.get(name, [])
    if change is not None:
        change(data)
    out = tmp_path / "out"
    assert main(sft_args((model, data), out, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"tether sft: error: {expected.format(data=data)}" or \
        err[-1].startswith(f"tether sft: error: {expected.format(data=data)}")
    assert not out.exists()


def test_a_directory_that_is_not_a_run_is_refused(files, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(sft_args(files, out)) == 2
    assert "is not a tether SFT run; refusing to replace it" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_the_sft_output_is_the_policy_of_train_rm_and_ppo(files, tmp_path):
    """SFT -> reward model -> PPO, each stage reading the previous one's directory as it is."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sft = tmp_path / "sft"
    assert main(sft_args(files, sft, "--lora-r", "4")) == 0
    AutoModelForCausalLM.from_pretrained(sft)  # a plain Hugging Face model (LoRA merged), with its tokenizer
    AutoTokenizer.from_pretrained(sft)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)})
                             + "\n" for i in range(10, 40)), encoding="utf-8")
    rm = tmp_path / "rm"
    assert main(["train-rm", "--model", str(sft), "--data", str(pairs), "--output-dir", str(rm), "--epochs", "1",
                 "--batch-size", "8", "--format", "plain"]) == 0
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(10, 26)), encoding="utf-8")
    ppo = tmp_path / "ppo"
    assert main(["ppo", "--policy", str(sft), "--prompts", str(prompts), "--reward", str(rm), "--output-dir",
                 str(ppo), "--steps", "1", "--batch-size", "4", "--mini-batches", "2", "--max-new-tokens", "4",
                 "--progress", "false"]) == 0
    rows = [json.loads(line) for line in (ppo / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # the default held-out evaluation at the start, then the step
    assert rows[1]["objective/kl"] == 0.0  # the reference is the SFT policy itself
    assert Path(ppo / "policy" / "model.safetensors").is_file()


def test_report_plots_an_sft_run(files, tmp_path, capsys):
    out = tmp_path / "sft"
    assert main(sft_args(files, out, "--eval-fraction", "0.25", "--eval-every", "1", "--gold", "none")) == 0
    assert main(["report", str(out), "-o", str(tmp_path / "report.html")]) == 0
    html = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "SFT: loss per labelled token" in html
