"""tether.rm.train: the evaluation (A4) against hand-computed values, a tiny model learning a
synthetic rule, the CLI end to end (in-process and as a subprocess), every bad input as one line with
exit code 2, and the atomic write of the output directory (A7)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_reward_model import save_tiny_bert, save_tiny_gpt2

from tether.cli import main
from tether.core.stats import wilson_interval
from tether.inputs.pairs import PreferencePair

REPO = Path(__file__).resolve().parents[1]


def script_rows(n: int, seed: int = 0) -> list[dict]:
    """Synthetic rule "reply in the prompt's script": the prompt is a word in upper or lower case; the
    chosen reply is a word in the same case, the rejected one the same word in the other case (so both
    sides always have the same length: length cannot explain the preference)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    rows = []
    for _ in range(n):
        word = "".join(rng.choice(letters) for _ in range(rng.randint(3, 6)))
        reply = "".join(rng.choice(letters) for _ in range(rng.randint(2, 5)))
        upper = rng.random() < 0.5
        rows.append({"prompt": (word.upper() if upper else word) + "?",
                     "chosen": reply.upper() if upper else reply, "rejected": reply if upper else reply.upper()})
    return rows


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("backbone"))


# ------------------------------------------------------------------------------------------- evaluation
class TableScorer:
    """A fake scorer: a fixed score per reply text."""

    def __init__(self, table: dict[str, float]):
        self.table = table

    def score(self, prompts, responses, raw=False, batch_size=64):
        return torch.tensor([self.table[r] for r in responses])


def test_evaluate_pairs_matches_hand_computed_values():
    from tether.rm.evaluate import evaluate_pairs, format_evaluation

    #         chosen  rejected   r_w  r_l   correct  chosen is   model prefers
    pairs = [("aaaa", "b", 2.0, 1.0),     # yes      longer      longer
             ("a", "bbbb", 0.0, 1.0),     # no       shorter     longer
             ("cc", "dd", 1.0, 1.0),      # no (tie) same        -
             ("eee", "ff", 3.0, 0.0),     # yes      longer      longer
             ("g", "hhh", 2.0, 1.0),      # yes      shorter     shorter
             ("iiiiii", "j", -1.0, 0.0)]  # no       longer      shorter
    scorer = TableScorer({c: sc for c, _, sc, _ in pairs} | {r: sr for _, r, _, sr in pairs})
    ev = evaluate_pairs(scorer, [PreferencePair("p", c, r) for c, r, _, _ in pairs])
    assert (ev["n_pairs"], ev["n_correct"], ev["accuracy"], ev["n_ties"]) == (6, 3, 0.5, 1)
    assert (ev["wilson_low"], ev["wilson_high"]) == wilson_interval(3, 6) and not ev["excludes_chance"]
    assert ev["mean_margin"] == pytest.approx((1 - 1 + 0 + 3 + 1 - 1) / 6)
    assert (ev["chosen_longer"]["n"], ev["chosen_longer"]["accuracy"]) == (3, pytest.approx(2 / 3))
    assert (ev["chosen_shorter"]["n"], ev["chosen_shorter"]["accuracy"]) == (2, 0.5)
    assert (ev["same_length"]["n"], ev["same_length"]["accuracy"]) == (1, 0.0)
    assert ev["length_balanced_accuracy"] == pytest.approx((2 / 3 + 0.5) / 2)
    assert ev["prefers_longer"] == pytest.approx(3 / 5) and ev["longer_wins_baseline"] == pytest.approx(3 / 5)
    assert sum(b["n"] for b in ev["by_length"]) == 6
    assert sum(b["n"] * b["accuracy"] for b in ev["by_length"]) == pytest.approx(3)
    table = format_evaluation(ev)
    assert "0.500" in table and "includes 0.5" in table


def test_length_penalty_is_the_squared_correlation():
    from tether.core.length import length_penalty

    scores, lengths = torch.tensor([1.0, 2.0, 0.5, 4.0]), torch.tensor([3, 5, 2, 4])
    r = torch.corrcoef(torch.stack([scores, lengths.float()]))[0, 1]
    assert length_penalty(scores, lengths).item() == pytest.approx(r.item() ** 2, rel=1e-5)
    assert length_penalty(scores, torch.tensor([3, 3, 3, 3])).item() == 0.0


def test_length_expert_logit_by_hand():
    from tether.core.length import length_expert_logit

    got = length_expert_logit(torch.tensor(0.5), torch.tensor([8, 3, 0]), torch.tensor([2, 3, 4]))
    # 0.5 * ln(8/2), 0.5 * ln(3/3), 0.5 * ln(1/4) (an empty reply counts as one token)
    assert torch.allclose(got, torch.tensor([0.5 * 1.3862944, 0.0, -0.5 * 1.3862944]), atol=1e-6)


def test_fit_length_expert_is_the_length_only_bt_maximum():
    from tether.core.length import fit_length_expert

    # 3 of 4 pairs with log-ratio +1 won by the longer side: 3 (1 - s(w)) = s(w)  =>  w = ln 3
    assert fit_length_expert(torch.tensor([1.0, 1.0, 1.0, -1.0]), ridge=0.0) == pytest.approx(1.0986123, abs=1e-6)
    d = torch.randn(200, generator=torch.Generator().manual_seed(0)).double() + 0.3
    grid = torch.linspace(-3, 3, 60001, dtype=torch.float64)
    objective = torch.nn.functional.logsigmoid(grid[:, None] * d[None, :]).sum(1) - 0.5 * 0.1 * grid ** 2
    assert fit_length_expert(d, ridge=0.1) == pytest.approx(grid[objective.argmax()].item(), abs=2e-4)


def length_mostly_pairs(n: int, seed: int = 0) -> list[PreferencePair]:
    """The longer reply wins 80% of pairs; the words are random: length is the only signal."""
    rng = random.Random(seed)
    words = lambda k: " ".join("".join(rng.choice("abcdefgh") for _ in range(3)) for _ in range(k))  # noqa: E731
    pairs = []
    for i in range(n):
        long, short = words(rng.randint(4, 7)), words(rng.randint(1, 3))
        pairs.append(PreferencePair(f"q{i}?", long, short) if rng.random() < 0.8 else
                     PreferencePair(f"q{i}?", short, long))
    return pairs


@pytest.mark.slow
def test_length_expert_carries_the_length_preference_instead_of_the_model(tmp_path):
    """On data where only length predicts, the plain BT model becomes a length detector; with the length
    expert, w takes the length preference and the reward model's own scores keep far less of it."""
    from tether.rm.train import RewardTrainingConfig, train_reward_model

    prefers_longer, weights = {}, {}
    for expert in (False, True):
        cfg = RewardTrainingConfig(model=str(save_tiny_gpt2(tmp_path / f"m{expert}")), seed=0,
                                   output_dir=str(tmp_path / f"rm{expert}"))
        cfg.data.max_length, cfg.loss.length_expert = 48, expert
        cfg.optim.lr, cfg.optim.epochs, cfg.optim.batch_size = 3e-3, 4, 16
        rm = train_reward_model(cfg, pairs=length_mostly_pairs(300))
        prefers_longer[expert] = rm.metadata["evaluation"]["prefers_longer"]
        weights[expert] = rm.metadata["run"].get("length_expert_w")
    assert weights[False] is None and weights[True] > 0.5
    assert prefers_longer[False] > 0.9  # the trap, reproduced
    assert prefers_longer[True] < prefers_longer[False] - 0.2, (prefers_longer, weights)


# --------------------------------------------------------------------------------------------- learning
@pytest.mark.slow
def test_tiny_model_learns_the_synthetic_rule(tmp_path):
    from tether.inputs.pairs import pair_from_record
    from tether.rm.train import RewardTrainingConfig, train_reward_model

    pairs = [pair_from_record(r, f"row {i}") for i, r in enumerate(script_rows(300))]
    cfg = RewardTrainingConfig(model=str(save_tiny_gpt2(tmp_path / "m", width=64)), output_dir=str(tmp_path / "rm"),
                               seed=0)
    cfg.data.max_length = 32
    cfg.optim.lr, cfg.optim.epochs, cfg.optim.batch_size = 3e-3, 12, 16
    rm = train_reward_model(cfg, pairs=pairs)
    ev = json.loads((tmp_path / "rm" / "eval.json").read_text())
    assert ev == rm.metadata["evaluation"] and ev["n_pairs"] == 60
    assert ev["accuracy"] >= 0.9 and ev["excludes_chance"]


# ----------------------------------------------------------------------------------------------- the CLI
def test_cli_end_to_end_in_process(tmp_path, backbone, capsys):
    from transformers import AutoModelForSequenceClassification

    from tether import RewardModel

    rows = script_rows(40)
    data = write_jsonl(tmp_path / "pairs.jsonl", [*rows[:20], "{broken", *rows[20:]])
    config = tmp_path / "rm.yaml"
    config.write_text("seed: 3\noptim:\n  lr: 0.001\n  epochs: 3\ndata:\n  max_length: 8\n", encoding="utf-8")
    out = tmp_path / "rm"
    rc = main(["train-rm", "--config", str(config), "--model", str(backbone), "--data", str(data),
               "--output-dir", str(out), "--epochs", "2", "--batch-size", "8", "--skip-invalid", "--balance-length"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "41 rows read, 40 pairs kept; skipped: 0 identical sides, 0 no shared prompt, 1 invalid" in printed
    assert "held-out evaluation (8 pairs)" in printed
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tether_reward.json", "eval.json",
                 "config.yaml"):
        assert (out / name).is_file(), name
    saved = yaml.safe_load((out / "config.yaml").read_text())
    # seed, lr from YAML; epochs from the flag over YAML's 3; max_length from YAML
    assert (saved["seed"], saved["optim"]["lr"], saved["optim"]["epochs"], saved["data"]["max_length"]) == \
        (3, 0.001, 2, 8)
    ev = json.loads((out / "eval.json").read_text())
    assert {"accuracy", "wilson_low", "wilson_high", "n_pairs", "excludes_chance", "mean_margin"} <= set(ev)
    meta = json.loads((out / "tether_reward.json").read_text())
    assert meta["data"]["train"] + meta["data"]["held_out"] == 40 and meta["data"]["held_out"] == ev["n_pairs"]
    assert meta["data"]["prompt_truncated"] > 0 and meta["data"]["reply_truncated"] == 0  # max_length 8
    assert meta["text_format"] == {"kind": "plain", "separator": "", "max_length": 8,
                                   "truncation": "prompt from the left, then reply from the right"}
    assert AutoModelForSequenceClassification.from_pretrained(out).config.num_labels == 1
    rm = RewardModel.from_pretrained(out, device="cpu")
    # the reference sample is every reply here (held-out + all train pairs, norm_sample 1000 > 32)
    z = rm.score([r["prompt"] for r in rows for _ in range(2)], [r[k] for r in rows for k in ("chosen", "rejected")])
    assert abs(z.mean().item()) < 1e-4 and abs(z.std(unbiased=False).item() - 1) < 1e-4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.jsonl", "rm", "rm.yaml"]  # no temporary folder
    # One metrics row per optimiser step: 2 epochs x ceil(train pairs / 8), steps numbered from 1.
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    n_train = meta["data"].get("balanced_train", meta["data"]["train"])
    per_epoch = -(-n_train // 8)
    assert [r["step"] for r in history] == list(range(1, 2 * per_epoch + 1))
    assert [r["epoch"] for r in history] == [1] * per_epoch + [2] * per_epoch
    assert history[-1]["rm/loss"] == meta["run"]["final_train_loss"]
    assert all(0 <= r["rm/accuracy"] <= 1 and r["rm/grad_norm"] > 0 for r in history)
    assert main(["report", str(out), "-o", str(tmp_path / "rm.html")]) == 0  # tether report plots an RM run
    page = (tmp_path / "rm.html").read_text()
    assert "Reward model: training loss" in page and "Reward model: batch accuracy" in page


def test_cli_balance_replies_trains_on_the_balanced_subset(tmp_path, backbone, capsys):
    from tether.inputs.pairs import balance_by_reply, load_preference_pairs, split_pairs

    # "yes" and "no" each chosen as often as rejected; "maybe" only ever rejected (a disfavoured text)
    rows = [{"prompt": f"question {i}", "chosen": ("yes", "no")[i % 2], "rejected": ("no", "yes")[i % 2]}
            for i in range(24)] + [{"prompt": f"other {i}", "chosen": "yes", "rejected": "maybe"} for i in range(12)]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "rm"
    assert main(["train-rm", "--model", str(backbone), "--data", str(data), "--output-dir", str(out),
                 "--epochs", "1", "--batch-size", "8", "--balance-replies"]) == 0
    train = split_pairs(load_preference_pairs([data])[0], 0.2, 0)[0]
    expected = balance_by_reply(train, 0)
    assert all(p.rejected != "maybe" for p in expected) and len(expected) < len(train)
    meta = json.loads((out / "tether_reward.json").read_text())
    assert meta["data"]["reply_balanced_train"] == len(expected)
    assert f"balance-replies: kept {len(expected)} of {len(train)} train pairs" in capsys.readouterr().out
    # no text both chosen and rejected: nothing to train on, a one-line error and nothing written
    one_sided = write_jsonl(tmp_path / "one.jsonl", [{"prompt": f"q{i}", "chosen": f"right {i}", "rejected": "wrong"}
                                                    for i in range(10)])
    assert main(["train-rm", "--model", str(backbone), "--data", str(one_sided), "--output-dir",
                 str(tmp_path / "rm2"), "--balance-replies"]) != 0
    assert "--balance-replies kept no pair" in capsys.readouterr().err and not (tmp_path / "rm2").exists()


@pytest.mark.slow
def test_cli_subprocess_encoder_with_lora_writes_a_plain_model(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from tether import RewardModel

    data = tmp_path / "pairs.csv"
    data.write_text("prompt,chosen,rejected\n" + "".join(f"{r['prompt']},{r['chosen']},{r['rejected']}\n"
                                                         for r in script_rows(30)), encoding="utf-8")
    out = tmp_path / "rm"
    bert = save_tiny_bert(tmp_path / "bert")
    argv = ["train-rm", "--model", str(bert), "--data", str(data), "--output-dir", str(out), "--lora-r", "4",
            "--lr", "1e-3", "--batch-size", "8", "--max-length", "16"]
    proc = subprocess.run([sys.executable, "-m", "tether", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "held-out evaluation" in proc.stdout and "LoRA r=4" in proc.stdout
    assert not (out / "adapter_config.json").exists()  # merged: a plain transformers model
    plain = AutoModelForSequenceClassification.from_pretrained(out)
    assert type(plain).__name__ == "BertForSequenceClassification"
    assert not any("lora" in n for n, _ in plain.named_parameters())
    assert RewardModel.from_pretrained(out, device="cpu").pooling == "model"


# --------------------------------------------------------------------------------------------- bad input
def _bad_cases(tmp: Path, backbone: Path) -> dict[str, tuple[list[str], str]]:
    good = write_jsonl(tmp / "good.jsonl", script_rows(10))
    (tmp / "a.txt").write_text("x")
    write_jsonl(tmp / "badjson.jsonl", [script_rows(1)[0], '{"prompt": "p", "chosen": '])
    (tmp / "nocol.csv").write_text("prompt,chosen\np,c\n")
    write_jsonl(tmp / "nofield.jsonl", [{"prompt": "p", "rejected": "r"}])
    write_jsonl(tmp / "empty.jsonl", [script_rows(1)[0], {"prompt": "p", "chosen": "", "rejected": "r"}])
    (tmp / "latin1.jsonl").write_bytes(b'{"prompt": "p", "chosen": "c", "rejected": "r"}\n{"prompt": "caf\xe9"}\n')
    (tmp / "nomodel").mkdir()
    (tmp / "unknown.yaml").write_text("optim:\n  lrr: 0.1\n")
    (tmp / "wrongtype.yaml").write_text("optim:\n  lr: fast\n")
    (tmp / "userdir").mkdir()
    (tmp / "userdir" / "notes.txt").write_text("precious")
    return {
        "missing file": (["--data", str(tmp / "nope.jsonl")], "nope.jsonl: file not found"),
        "unknown extension": (["--data", str(tmp / "a.txt")], "a.txt: unknown file type '.txt'"),
        "invalid JSON": (["--data", str(tmp / "badjson.jsonl")], "badjson.jsonl: line 2: invalid JSON"),
        "missing column": (["--data", str(tmp / "nocol.csv")], "nocol.csv: missing column 'rejected'"),
        "missing field": (["--data", str(tmp / "nofield.jsonl")], "nofield.jsonl: line 1: missing field 'chosen'"),
        "empty text": (["--data", str(tmp / "empty.jsonl")], "empty.jsonl: line 2: field 'chosen' is empty"),
        "non-UTF-8": (["--data", str(tmp / "latin1.jsonl")], "latin1.jsonl: line 2: not UTF-8 text (byte 0xe9)"),
        "model without config": (["--data", str(good), "--model", str(tmp / "nomodel")],
                                 "nomodel: not a Hugging Face model directory (no config.json)"),
        "unknown YAML key": (["--data", str(good), "--config", str(tmp / "unknown.yaml")],
                             "unknown.yaml: key 'optim.lrr': unknown key 'optim.lrr'"),
        "YAML wrong type": (["--data", str(good), "--config", str(tmp / "wrongtype.yaml")],
                            "wrongtype.yaml: key 'optim.lr': expected a number, got 'fast'"),
        "flag wrong type": (["--data", str(good), "--epochs", "two"], "--epochs: expected an integer, got 'two'"),
        "out of range": (["--data", str(good), "--eval-fraction", "1.5"], "--eval-fraction: must be <= 0.9, got 1.5"),
        "not positive": (["--data", str(good), "--lr", "0"], "--lr: must be > 0.0, got 0.0"),
        "bad choice": (["--data", str(good), "--dtype", "float8"], "--dtype: 'float8' is not one of"),
        "no data": ([], "--data is required"),
        "user folder as output": (["--data", str(good), "--output-dir", str(tmp / "userdir")],
                                  "userdir: exists and is not a tether reward model; refusing to replace it"),
    }


def test_every_bad_input_is_one_line_with_exit_code_2(tmp_path, backbone, capsys):
    for name, (args, expected) in _bad_cases(tmp_path, backbone).items():
        base = {"--model": str(backbone), "--output-dir": str(tmp_path / "out")}
        for i in range(0, len(args), 2):
            base.pop(args[i], None)
        argv = ["train-rm", *[x for kv in base.items() for x in kv], *args]
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2, name
        assert err.count("\n") == 1 and err.startswith("tether train-rm: error: "), (name, err)
        assert expected in err, (name, err)
    assert (tmp_path / "userdir" / "notes.txt").read_text() == "precious"
    assert not (tmp_path / "out").exists()


def test_unknown_flag_is_one_line_with_exit_code_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train-rm", "--lora-rank", "4"])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1


# ---------------------------------------------------------------------------------------- atomic write
def test_a_crash_while_saving_leaves_the_previous_model_intact(tmp_path, monkeypatch):
    from test_reward_model import load_rm

    from tether.rm.config import RewardTrainingConfig
    from tether.rm.model import RewardModel
    from tether.rm.train import save_reward_model

    out = tmp_path / "rm"
    cfg = RewardTrainingConfig(model="m", output_dir=str(out))
    good = load_rm(save_tiny_gpt2(tmp_path / "m"))
    save_reward_model(good, out, cfg, {"accuracy": 0.9}, [])
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def crash(self, path, extra=None):
        (Path(path) / "model.safetensors").write_bytes(b"half a model")
        raise OSError("disk full")

    monkeypatch.setattr(RewardModel, "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        save_reward_model(good, out, cfg, {"accuracy": 0.1}, [])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "rm"]  # no temporary folder left behind
    monkeypatch.undo()
    save_reward_model(good, out, cfg, {"accuracy": 0.5}, [])  # a good save replaces the old model
    assert json.loads((out / "eval.json").read_text()) == {"accuracy": 0.5}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "rm"]


# ------------------------------------------------------------------------------ gradient accumulation
def test_one_batch_of_8_equals_8_accumulated_batches_of_1(backbone, monkeypatch):
    """The accumulated gradient is that of the mean loss over the step's pairs, however they are cut:
    batch 8 x 1 and batch 1 x 8 accumulation give the same gradient at the optimiser step (fp32 tolerance).
    Replies of different lengths, so that the batch of 8 is padded and the single pairs are not. (Gradients,
    not weights: Adam's first update is g/|g| per element, which turns float noise in a near-zero gradient
    into a full step.)"""
    import copy

    from test_reward_model import load_rm

    from tether.hf import disable_dropout
    from tether.rm.config import RewardTrainingConfig
    from tether.rm.train import train_loop

    rm = load_rm(backbone)
    disable_dropout(rm.model)
    rows = script_rows(8, seed=3)
    pairs = [(rm.text_format.encode(rm.tokenizer, r["prompt"], r["chosen"]),
              rm.text_format.encode(rm.tokenizer, r["prompt"], r["rejected"] + "zz" * i)) for i, r in enumerate(rows)]
    assert len({len(c.ids) for c, _ in pairs}) > 1  # really ragged
    clip = torch.nn.utils.clip_grad_norm_
    grads: list[dict] = []

    def record_then_clip(params, max_norm, *args, **kwargs):  # the gradient the optimiser is about to use
        grads.append([p.grad.detach().clone() for p in params])
        return clip(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", record_then_clip)
    norms = []
    for batch_size, accumulation in ((8, 1), (1, 8)):
        cfg = RewardTrainingConfig(seed=0)
        cfg.optim.batch_size, cfg.optim.grad_accumulation = batch_size, accumulation
        history = train_loop(copy.deepcopy(rm.model), pairs, cfg, torch.device("cpu"), rm.tokenizer.pad_token_id)
        assert len(history) == 1  # one optimiser step either way
        norms.append(history[0]["rm/grad_norm"])
    assert len(grads) == 2 and norms[0] > 0
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    for g_big, g_accumulated in zip(*grads):
        torch.testing.assert_close(g_big, g_accumulated, rtol=1e-4, atol=1e-7)
