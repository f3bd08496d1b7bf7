"""Every bad input a user can give gets one line naming the file, row or flag, exit code 2, no traceback,
and leaves earlier outputs as they were (SPEC F). One table: config files, data files, model and reward
directories, rule specs, prompts longer than the context, --resume against different settings."""

import json

import pytest
from bad_inputs import build

from tether.cli import main


@pytest.fixture(scope="module")
def f(tmp_path_factory):
    return build(tmp_path_factory.mktemp("bad_input"))


def ppo(f, out, **flags):
    args = {"--policy": f["policy"], "--prompts": f["prompts"], "--reward": "tether.rules:char_share",
            "--output-dir": out, "--steps": "1", "--batch-size": "4", "--mini-batches": "2",
            "--max-new-tokens": "5", "--progress": "false", **flags}
    return ["ppo", *[str(x) for kv in args.items() for x in kv]]


def train_rm(f, out, **flags):
    args = {"--model": f["policy"], "--data": f["one_pair.jsonl"], "--output-dir": out, **flags}
    return ["train-rm", *[str(x) for kv in args.items() for x in kv]]


# (id, command, {flag: file key or value}, text the one line must contain)
CASES = [
    # config files
    ("yaml unknown top key", ppo, {"--config": "unknown_top.yaml"}, "unknown_top.yaml: key 'stepz': unknown key"),
    ("yaml wrong type", ppo, {"--config": "wrong_type.yaml"}, "wrong_type.yaml: key 'steps': expected an integer"),
    ("yaml section as scalar", ppo, {"--config": "section_scalar.yaml"},
     "section_scalar.yaml: key 'kl': 'kl' is a section"),
    ("yaml key in wrong section", ppo, {"--config": "key_wrong_section.yaml"},
     "key_wrong_section.yaml: key 'coef': unknown key"),
    ("yaml not a mapping", ppo, {"--config": "not_mapping.yaml"}, "not_mapping.yaml: expected a mapping"),
    ("yaml syntax", ppo, {"--config": "bad_syntax.yaml"}, "bad_syntax.yaml: line 2 invalid YAML"),
    ("yaml list for scalar", ppo, {"--config": "list_for_scalar.yaml"},
     "list_for_scalar.yaml: key 'steps': expected an integer"),
    ("yaml scalar for list", ppo, {"--config": "scalar_for_list.yaml"},
     "scalar_for_list.yaml: key 'reward.sources': expected a list"),
    ("config file missing", ppo, {"--config": "@nope.yaml"}, "nope.yaml: config file not found"),
    # prompt files
    ("prompts wrong columns", ppo, {"--prompts": "wrong_columns.jsonl"},
     "wrong_columns.jsonl: line 1: no prompt column"),
    ("prompts undecodable", ppo, {"--prompts": "undecodable.jsonl"},
     "undecodable.jsonl: line 2: not UTF-8 text (byte 0xe9)"),
    ("prompts empty prompt", ppo, {"--prompts": "empty_prompt.jsonl"}, "empty_prompt.jsonl: line 2: empty prompt"),
    ("prompts not objects", ppo, {"--prompts": "not_object.jsonl"}, "not_object.jsonl: line 1: expected a JSON object"),
    ("prompts huge line", ppo, {"--prompts": "huge_line.jsonl"}, "huge_line.jsonl: prompt '1111"),
    ("eval prompts missing", ppo, {"--eval-prompts": "@nope.jsonl"}, "nope.jsonl: file not found"),
    ("prompt + reply over the context", ppo, {"--max-new-tokens": "60"},
     "+ --max-new-tokens 60 > the policy's context of 64 positions"),
    # model directories
    ("policy without weights", ppo, {"--policy": "no_weights"}, "no_weights: cannot load the model (OSError"),
    ("policy without tokenizer", ppo, {"--policy": "no_tokenizer"}, "no_tokenizer: no tokenizer files"),
    ("policy corrupt safetensors", ppo, {"--policy": "corrupt"}, "corrupt: cannot load the model (SafetensorError"),
    ("policy config not JSON", ppo, {"--policy": "bad_config"}, "bad_config: cannot load the tokenizer (OSError"),
    ("policy wrong architecture", ppo, {"--policy": "wrong_architecture"},
     "wrong_architecture: not a causal language model"),
    ("tokenizer without pad or eos", ppo, {"--policy": "no_pad_no_eos"},
     "no_pad_no_eos: the tokenizer has neither a pad nor an EOS"),
    # reward directories
    ("reward dir is a plain LM", ppo, {"--reward": "policy"},
     "policy: not a tether reward model (no tether_reward.json)"),
    ("reward dir without metadata", ppo, {"--reward": "no_metadata_rm"}, "no_metadata_rm: not a tether reward model"),
    ("reward dir corrupt weights", ppo, {"--reward": "corrupt_rm"}, "corrupt_rm: cannot load model weights"),
    # rule specs
    ("rule not callable", ppo, {"--reward": "@bad_rules:not_callable"},
     "module 'bad_rules' has no function 'not_callable'"),
    ("rule raises on every row", ppo, {"--reward": "@bad_rules:raises_always"},
     "rule raises_always: raised on every response (KeyError: 'answer')"),
    ("rule returns strings", ppo, {"--reward": "@bad_rules:strings"},
     "rule strings: returned 'good' (str), not a number"),
    ("rule wrong length", ppo, {"--reward": "@bad_rules:wrong_length"},
     "rule wrong_length: returned 5 scores for 4 responses"),
    ("rule returns a scalar", ppo, {"--reward": "@bad_rules:not_a_list"},
     "rule not_a_list: returned float, not a list"),
    ("rule argument without =", ppo, {"--reward": "@tether.rules:char_share:char"}, "rule arguments must be key=value"),
    ("gold rule missing", ppo, {"--gold": "@tether.rules:nope"}, "module 'tether.rules' has no function 'nope'"),
    # new flags
    ("save-every-minutes negative", ppo, {"--save-every-minutes": "@-1"}, "--save-every-minutes: must be >= 0.0"),
    ("max-skipped-steps zero", ppo, {"--max-skipped-steps": "@0"}, "--max-skipped-steps: must be >= 1"),
    # train-rm
    ("train-rm one pair", train_rm, {}, "one_pair.jsonl"),
    ("train-rm empty file", train_rm, {"--data": "empty.jsonl"}, "empty.jsonl"),
    ("train-rm wrong columns", train_rm, {"--data": "pairs_wrong_columns.jsonl"},
     "pairs_wrong_columns.jsonl: line 1: missing field"),
    ("train-rm model without tokenizer", train_rm, {"--model": "no_tokenizer", "--data": "pairs.jsonl"},
     "no_tokenizer: no tokenizer files"),
    ("train-rm corrupt model", train_rm, {"--model": "corrupt", "--data": "pairs.jsonl"},
     "corrupt: cannot load model weights"),
]


def resolve(f, tmp_path, value):
    """A key of the built files, "@nope.yaml"/"@nope.jsonl" (a missing file), or "@x" (the literal x)."""
    if value in f:
        return f[value]
    if value.endswith((".yaml", ".jsonl")):
        return tmp_path / value[1:]
    return value[1:] if value.startswith("@") else value


def earlier_run(out):
    """What a run killed before its first checkpoint leaves: a failed start must not touch it."""
    (out / "samples").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "objective/scores": 0.5}\n')
    (out / "samples" / "step_1.jsonl").write_text('{"prompt": "p"}\n')
    return {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}


@pytest.mark.parametrize("name, command, flags, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_outputs_intact(f, tmp_path, capsys, name, command, flags, expected):
    out = tmp_path / "out"
    # A rule that raises on every row is only seen at step 1, once the run directory is prepared.
    before = earlier_run(out) if command is ppo and "raises_always" not in str(flags) else None
    code = main(command(f, out, **{k: resolve(f, tmp_path, v) for k, v in flags.items()}))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and expected in err[0], err
    if before is not None:
        assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    elif command is train_rm:
        assert not out.exists()


def test_resume_with_different_settings_is_refused(f, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(ppo(f, out)) == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    code = main(ppo(f, out, **{"--kl-coef": "0.2", "--steps": "2"}) + ["--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--resume: kl.coef is 0.2 but the run in" in err[0] and "was made with 0.05" in err[0], err
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert main(ppo(f, out, **{"--steps": "2", "--eval-every": "1"}) + ["--resume"]) == 0  # these may change
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
