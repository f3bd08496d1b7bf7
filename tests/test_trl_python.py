"""The Python a TRL user writes, run against tether (#49 item 4): TRL's config names accepted or answered with the
tether key, TRL's trainer arguments (``args=``, ``model=`` as a name, ``train_dataset=``/``eval_dataset=``,
``reward_funcs=``), datasets as path strings, ``tether.diagnose``/``tether.report``; and the two pages that tell a
TRL user what carries over (docs/data-formats.md, docs/coming-from-trl.md) checked against the code."""

import json
import re

import pytest
import torch

import tether
from tether.errors import TetherError

from test_trl_shapes import reward_len
from tiny import make_policy_dir, make_prompts_file, tiny_config


def test_trl_config_names_are_accepted_or_answered_with_the_tether_key():
    from tether.errors import ConfigError
    from tether.trl_compat.keys import TRL_KEYS, config_keys

    cfg = tether.PPOConfig(learning_rate=3e-6, beta=0.02, num_generations=4, max_completion_length=64,
                           output_dir="out", model_name_or_path="some/policy")
    assert tether.PPOConfig is tether.RunConfig and tether.RewardConfig is tether.RewardTrainingConfig
    assert (cfg.optim.lr, cfg.kl.coef, cfg.samples_per_prompt, cfg.generation.max_new_tokens, cfg.output_dir,
            cfg.model.policy) == (3e-6, 0.02, 4, 64, "out", "some/policy")
    sft = tether.SFTConfig(num_train_epochs=3, per_device_train_batch_size=2, max_length=128)
    assert (sft.optim.epochs, sft.optim.batch_size, sft.data.max_length) == (3, 2, 128)
    assert tether.RewardConfig(per_device_train_batch_size=4).optim.batch_size == 4
    with pytest.raises(ConfigError, match=r"^RunConfig\(lr=\.\.\.\): unknown key 'lr'; did you mean `optim.lr` "
                                          r"\(--lr\)\?$"):
        tether.RunConfig(lr=1e-5)
    with pytest.raises(ConfigError, match=r"^RunConfig\(per_device_train_batch_size=\.\.\.\): unknown key "
                                          r"'per_device_train_batch_size' \(TRL's name\); in tether: `batch_size` "):
        tether.RunConfig(per_device_train_batch_size=8)
    dpo = tether.DPOConfig(beta=0.5, loss_type="ipo", per_device_train_batch_size=4, precompute_ref_log_probs=False)
    assert (dpo.loss.beta, dpo.loss.loss_type, dpo.optim.batch_size, dpo.precompute_ref_log_probs) == (0.5, "ipo", 4,
                                                                                                       False)
    for cls in (tether.RunConfig, tether.SFTConfig, tether.RewardTrainingConfig, tether.DPOConfig):  # real keys
        assert set(TRL_KEYS[cls.__name__].values()) <= set(config_keys(cls))


def test_trl_names_in_a_dict_or_yaml_config_and_their_bad_values_are_named(tmp_path):
    from tether.config import as_config
    from tether.errors import ConfigError

    cfg = as_config(tether.RunConfig, {"learning_rate": 2e-6, "kl.coef": 0.3, "max_steps": 7}, check=False)
    assert (cfg.optim.lr, cfg.kl.coef, cfg.steps) == (2e-6, 0.3, 7)
    (tmp_path / "c.yaml").write_text("num_train_epochs: 2\nlearning_rate: 1.0e-4\n")
    sft = as_config(tether.SFTConfig, str(tmp_path / "c.yaml"), check=False)
    assert (sft.optim.epochs, sft.optim.lr) == (2, 1e-4)
    with pytest.raises(ConfigError, match=r"unknown key 'kl.coeff'; did you mean `kl.coef` \(--kl-coef\)\?"):
        as_config(tether.RunConfig, {"kl": {"coeff": 0.1}}, check=False)


@pytest.fixture(scope="module")
def ppo_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_ppo")
    return make_policy_dir(root), make_prompts_file(root, n=16)


def test_ppo_takes_a_path_string_and_trls_argument_names(ppo_files, tmp_path):
    import yaml

    policy, prompts = ppo_files
    cfg = tiny_config(tmp_path, policy, tmp_path / "unused.jsonl", steps=1, batch_size=4)
    cfg.reward.sources = []
    result = tether.PPOTrainer(cfg, prompts=str(prompts), reward=reward_len).train()  # #49's refused call
    saved = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert saved["data"]["prompts"] == str(prompts) and result.steps == 1  # the path, as --prompts records it
    settings = {"output_dir": str(tmp_path / "trl"), "max_steps": 1, "learning_rate": 1e-3, "batch_size": 4,
                "max_completion_length": 6, "progress": False, "reward.gold": "none", "ppo.mini_batches": 2}
    trl = tether.PPOTrainer(args=settings, model=str(policy), reward_funcs=[reward_len], train_dataset=str(prompts),
                            eval_dataset=str(prompts)).train()
    saved = yaml.safe_load((trl.run_dir / "config.yaml").read_text())
    assert (saved["model"]["policy"], saved["data"]["eval_prompts"], saved["optim"]["lr"]) == \
        (str(policy), str(prompts), 1e-3)
    assert saved["reward"]["sources"] == ["test_trl_shapes:reward_len"]
    with pytest.raises(TetherError, match=r"^PPOTrainer: prompts and train_dataset name the same thing; give one$"):
        tether.PPOTrainer(cfg, prompts=str(prompts), train_dataset=str(prompts))


def test_sft_trainer_called_as_trl_calls_it_trains_text_rows_on_every_token(tmp_path):
    from transformers import AutoModelForCausalLM

    from tether.sft.evaluate import held_out_loss

    policy = make_policy_dir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(policy)  # the tokenizer is found from model.name_or_path
    texts = [f"{a}+{b}={a + b}" for a, b in ((12, 30), (7, 8), (40, 2), (3, 99), (10, 10), (5, 6))]
    trainer = tether.SFTTrainer(model=model, train_dataset=[{"text": t} for t in texts[:4]],
                                eval_dataset=[{"text": t} for t in texts[4:]],
                                args={"num_train_epochs": 1, "per_device_train_batch_size": 2, "learning_rate": 1e-3,
                                      "output_dir": str(tmp_path / "sft"), "progress": False})
    run, tok = trainer.run, trainer.run.tokenizer
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts[4:]]
    total = 0.0
    with torch.no_grad():  # every next token of each held-out text, EOS included, one text at a time
        for row in ids:
            logp = torch.log_softmax(trainer.model(input_ids=torch.tensor([row])).logits[0].double(), -1)
            total -= sum(float(logp[t - 1, row[t]]) for t in range(1, len(row)))
    metrics = held_out_loss(run, 5)
    assert metrics["eval/tokens"] == sum(len(r) - 1 for r in ids)
    assert metrics["eval/loss"] == pytest.approx(total / metrics["eval/tokens"], abs=1e-5)
    assert trainer.train().steps == 2  # 4 rows, 2 a step, one epoch
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prompts = make_prompts_file(tmp_path, n=4)
    by_path = tether.SFTTrainer(model=str(policy), train_dataset=str(data), eval_prompts=str(prompts),
                                args={"output_dir": str(tmp_path / "sft2"), "progress": False, "max_steps": 1})
    assert (by_path.cfg.data.files, by_path.cfg.eval.prompts, by_path.cfg.model.path) == \
        ([str(data)], str(prompts), str(policy))  # recorded as the flags record them
    assert len(by_path.run.eval_rows) == 4 and by_path.run.data_info["train_rows"] + by_path.run.data_info[
        "held_out_rows"] == len(texts)


def test_reward_trainer_takes_trls_names_and_a_path_and_refuses_eval_dataset_in_one_line(tmp_path):
    from tether.errors import ConfigError

    policy = make_policy_dir(tmp_path)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)})
                             + "\n" for i in range(12)))
    result = tether.RewardTrainer(model=str(policy), train_dataset=str(pairs),
                                  args={"output_dir": str(tmp_path / "rm"), "num_train_epochs": 1,
                                        "per_device_train_batch_size": 4}).train()
    meta = json.loads((result.run_dir / "tether_reward.json").read_text())
    assert meta["training"]["data"]["files"] == [str(pairs)] and meta["training"]["model"] == str(policy)
    with pytest.raises(ConfigError, match=r"^RewardTrainer\(eval_dataset=\.\.\.\): tether holds out"):
        tether.RewardTrainer(model=str(policy), train_dataset=str(pairs), eval_dataset=str(pairs))


def test_diagnose_and_report_at_the_top_level(ppo_files, tmp_path):
    from tether.diagnostics.doctor import diagnose_run

    policy, prompts = ppo_files
    run_dir = tether.PPOTrainer(tiny_config(tmp_path, policy, prompts, steps=1, batch_size=4)).train().run_dir
    assert tether.diagnose(run_dir).summary() == diagnose_run(run_dir).summary()
    page = tether.report(run_dir)
    assert page == run_dir / "report.html" and "<html" in page.read_text()[:200].lower()


# ------------------------------------------------------------------------------------ docs/data-formats.md is true
def doc_rows(section: str) -> list[dict]:
    """The literal JSONL rows of one section (``## ...``) of docs/data-formats.md."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "data-formats.md").read_text(encoding="utf-8")
    part = page.split(f"\n## {section}", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```jsonl\n(.*?)^```", part, re.S | re.M)
    return [json.loads(line) for block in blocks for line in block.splitlines() if line.strip()]


def test_every_row_on_the_data_formats_page_is_read_by_the_real_readers():
    from tether.inputs.pairs import PreferencePair, pair_from_record
    from tether.inputs.prompt_rows import prompt_rows
    from tether.rm.steps import example_from_record
    from tether.sft.data import row_from_record

    sft = [row_from_record(r, f"sft {i}") for i, r in enumerate(doc_rows("SFT rows"))]
    assert len(sft) == 6 and [r.whole_text for r in sft] == [True] + [False] * 5
    assert {r.completion for r in sft[1:5]} >= {"42"}
    pairs = [pair_from_record(r, f"pair {i}") for i, r in enumerate(doc_rows("Preference pairs"))]
    assert len(pairs) == 4 and all(isinstance(p, PreferencePair) for p in pairs)
    assert {(p.chosen.strip(), p.rejected.strip()) for p in pairs} == {("42", "43")}
    prompts = prompt_rows(list(enumerate(doc_rows("Prompts"), start=1)), lambda n: f"prompt {n}", "doc")
    assert len(prompts) == 5 and [r.get("answer") for r in prompts] == ["42", None, "42", "42", None]
    steps = [example_from_record(r, f"steps {i}", "\n") for i, r in enumerate(doc_rows("Step-labelled data"))]
    assert [s.labels for s in steps] == [[1, 0], [1, 1], [1, 0]] and all(len(s.steps) == 2 for s in steps)


def test_the_coming_from_trl_tables_are_the_codes_table():
    from pathlib import Path

    from tether.trl_compat.keys import TRL_KEYS, config_keys

    page = (Path(__file__).resolve().parents[1] / "docs" / "coming-from-trl.md").read_text(encoding="utf-8")
    row = re.compile(r"^\| `(\w+)` \| `([\w.]+)` \| `(--[\w-]+)` \|$", re.M)
    for lead, cls in (("PPO and GRPO (", tether.RunConfig), ("SFT (", tether.SFTConfig),
                      ("Reward model (", tether.RewardTrainingConfig), ("DPO (", tether.DPOConfig)):
        table = page.split("\n" + lead, 1)[1].split("\n\n", 2)[1]  # the table after the lead-in line
        rows = row.findall(table)
        assert {(trl, key) for trl, key, _ in rows} == set(TRL_KEYS[cls.__name__].items()), lead
        assert all(config_keys(cls)[key] == flag for _, key, flag in rows), lead


def test_a_path_string_is_read_wherever_python_hands_over_a_dataset(tmp_path):
    from tether.inputs.pairs import pairs_from_data
    from tether.errors import DataError
    from tether.inputs.prompt_rows import prompts_from_data
    from tether.sft.data import rows_from_data

    def jsonl(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)

    prompts = jsonl("p.jsonl", [{"prompt": "2+2=", "answer": "4"}, {"question": "3+3?", "answer": "6"}])
    assert [r["prompt"] for r in prompts_from_data(prompts)] == ["2+2=", "3+3?"]
    rows, _ = rows_from_data(jsonl("s.jsonl", [{"text": "abc"}, {"prompt": "p", "completion": "c"}]), "train_data")
    assert [r.whole_text for r in rows] == [True, False]
    pairs, stats = pairs_from_data(jsonl("r.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}]))
    assert (pairs[0].chosen, stats.pairs) == ("a", 1)
    bad = jsonl("bad.jsonl", [{"text": "ok"}, {"text": ""}])
    with pytest.raises(DataError, match=rf"^{re.escape(bad)}: line 2: field 'text' is empty$"):  # the file's line
        rows_from_data(bad, "train_data")
