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
     "{policy}: not a"),  # (no tether_reward.json: tether's; #49 also takes a TRL sequence classifier)
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
    # settings that can never work (#49)
    ("policy is a reward model", ppo, {"--policy": "tiny_rm"},
     "--policy " + "{tiny_rm}: a tether reward model (tether_reward.json), not a policy; give it to --reward"),
    ("adaptive KL from beta 0", ppo, {"--kl-controller": "@adaptive", "--kl-coef": "@0"},
     "--kl-controller adaptive with --kl-coef 0: the controller multiplies beta, so a beta of 0 never moves"),
    ("proportional KL from beta 0", ppo, {"--kl-controller": "@proportional", "--kl-coef": "@0"},
     "--kl-controller proportional with --kl-coef 0"),
    ("eval-every with no held-out share", ppo, {"--eval-every": "@5", "--eval-fraction": "@0"},
     "--eval-every 5: no held-out prompts to evaluate (--eval-fraction 0 and no --eval-prompts)"),
    ("eval-every, too few prompts for the default share", ppo, {"--eval-every": "@5", "--prompts": "five_prompts.jsonl"},
     "--eval-every 5: no held-out prompts (--prompts " + "{five_prompts.jsonl} has 5 distinct prompts, too few"),
    ("eval-fraction of one distinct prompt", ppo, {"--eval-fraction": "@0.2", "--prompts": "one_prompt.jsonl"},
     "--eval-fraction 0.2: --prompts " + "{one_prompt.jsonl} has one distinct prompt"),
    # train-rm
    ("train-rm balance-length keeps no pair", train_rm, {"--data": "chosen_longer.jsonl", "--balance-length": "@true"},
     "chosen_longer.jsonl: --balance-length kept no pair: the chosen reply is longer in all"),
    ("train-rm balance-length keeps no pair, length expert", train_rm,
     {"--data": "chosen_longer.jsonl", "--balance-length": "@true", "--length-expert": "@true"},
     "chosen_longer.jsonl: --balance-length kept no pair"),
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
    for key, path in f.items():  # "{key}" in the expected text: that built file's path
        expected = expected.replace("{" + key + "}", str(path))
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
    # the step-0 evaluation of the first start (held-out prompts are evaluated by default), then the two steps
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def _set_key(cfg, key, value):
    obj = cfg
    *parts, last = key.split(".")
    for part in parts:
        obj = getattr(obj, part)
    setattr(obj, last, value)
    return cfg


@pytest.mark.parametrize("key, value, expected", [
    ("kl.coef", -1, "kl.coef (--kl-coef): must be >= 0.0, got -1"),
    ("steps", "three", "steps (--steps): expected an integer, got 'three'"),
    ("optim.lr", -1, "optim.lr (--lr): must be > 0.0, got -1"),
    ("generation.temperature", 0, "generation.temperature (--temperature): must be > 0.0, got 0"),
])
def test_validate_refuses_from_python_what_the_trainer_refuses(key, value, expected):
    """RunConfig.validate() is the one place of the checks: the trainer's check_config says the same line. A value
    set from Python is named by its key and its flag."""
    from tether.config import check_config
    from tether.errors import ConfigError
    from tether.ppo.config import RunConfig

    def config():
        cfg = RunConfig()
        cfg.model.policy, cfg.data.prompts, cfg.reward.sources = "policy", "prompts.jsonl", ["m:f"]
        return _set_key(cfg, key, value)

    with pytest.raises(ConfigError) as by_validate:
        config().validate()
    with pytest.raises(ConfigError) as by_trainer:
        check_config(config())
    assert str(by_validate.value).startswith(expected) and str(by_trainer.value) == str(by_validate.value)


@pytest.mark.parametrize("cls, key, value, expected", [
    ("tether.rm.config:RewardTrainingConfig", "optim.lr", -1.0, "optim.lr (--lr): must be > 0.0, got -1.0"),
    ("tether.rm.config:RewardTrainingConfig", "data.eval_fraction", 2.0, "data.eval_fraction (--eval-fraction): must"),
    ("tether.sft.config:SFTConfig", "optim.lr", -1.0, "optim.lr (--lr): must be > 0.0, got -1.0"),
])
def test_the_other_stages_validate_their_fields_too(cls, key, value, expected):
    import importlib

    from tether.errors import ConfigError

    module, name = cls.split(":")
    cfg = _set_key(getattr(importlib.import_module(module), name)(), key, value)
    with pytest.raises(ConfigError, match="^" + expected.replace("(", r"\(").replace(")", r"\)")):
        cfg.validate()


@pytest.mark.parametrize("keys, expected", [
    ({}, None),
    ({"critic.kind": "separate", "advantage.estimator": "grpo", "samples_per_prompt": 2},
     "--critic separate: ignored; --advantage grpo builds no critic"),
    ({"critic.model": "rm", "advantage.estimator": "rloo", "samples_per_prompt": 2},
     "--critic head --critic-model rm: ignored; --advantage rloo builds no critic"),
    ({"correction.mode": "tis"}, "--rollout-correction tis: the transformers engine samples with the trained weights"),
    ({"correction.mode": "tis", "generation.engine": "vllm"}, None),
    ({"data.eval_fraction": 0.2, "data.eval_prompts": "held.jsonl"},
     "--eval-fraction 0.2: ignored; the held-out prompts are --eval-prompts held.jsonl"),
    ({"data.eval_fraction": 0.2, "data.prompts": "rg:chain_sum"},
     "--eval-fraction 0.2: ignored; the held-out prompts are the task's own held-out problems"),
])
def test_settings_that_do_nothing_get_one_warning_line(keys, expected):
    from tether.ppo.config import RunConfig

    cfg = RunConfig()
    cfg.model.policy, cfg.data.prompts, cfg.reward.sources = "policy", "prompts.jsonl", ["m:f"]
    for key, value in keys.items():
        _set_key(cfg, key, value)
    cfg.validate()
    warnings = cfg.warnings()
    if expected is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warnings[0].startswith(expected), warnings


def test_a_warning_is_printed_once_and_the_run_goes_on(f, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(ppo(f, out, **{"--critic": "separate", "--advantage": "grpo", "--samples-per-prompt": "2"}))
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert code == 0 and len(warnings) == 1 and "--critic separate: ignored" in warnings[0], warnings
