"""tether dpo (issue #52 item 2): the loss against TRL's formulas and a hand value, the reply log-probs against a
plain transformers forward, the LoRA reference against the base model, a CLI run on a planted preference, an exact
resume, and a bad pairs file."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_reward_model import save_tiny_gpt2
from test_rm_resume import gpt2_with_dropout

from tether.cli import main
from tether.core.preference import dpo_loss, sequence_logps

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------- the loss
def trl_dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, loss_type,
                 label_smoothing):
    """TRL's ``DPOTrainer.dpo_loss`` (trl/trainer/dpo_trainer.py), its sigmoid and ipo branches as written there
    (``logits`` is TRL's name for h; ``losses.mean()`` as TRL's trainer takes it)."""
    logratios = chosen_logps - rejected_logps
    ref_logratios = ref_chosen_logps - ref_rejected_logps
    logits = logratios - ref_logratios
    if loss_type == "sigmoid":
        losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                  - F.logsigmoid(-beta * logits) * label_smoothing)
    elif loss_type == "ipo":
        # eqn (17) of the paper where beta is the regularization parameter for the IPO loss, denoted by tau in the paper.
        losses = (logits - 1 / (2 * beta)) ** 2
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps).detach()
    return losses.mean(), chosen_rewards, rejected_rewards


@pytest.mark.parametrize("loss_type,beta,smoothing", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2),
                                                      ("ipo", 0.1, 0.0), ("ipo", 1.0, 0.0)])
def test_the_loss_is_trls_formula_on_random_log_probs(loss_type, beta, smoothing):
    g = torch.Generator().manual_seed(7)
    logps = [-30 * torch.rand(64, generator=g, dtype=torch.float64) for _ in range(4)]
    loss, stats = dpo_loss(*logps, beta, loss_type, smoothing)
    expected, chosen_rewards, rejected_rewards = trl_dpo_loss(*logps, beta, loss_type, smoothing)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    # TRL's logged figures: rewards/chosen, rewards/rejected, accuracies, margins (means over the batch)
    torch.testing.assert_close(stats["rewards/chosen"], chosen_rewards.mean())
    torch.testing.assert_close(stats["rewards/rejected"], rejected_rewards.mean())
    torch.testing.assert_close(stats["rewards/accuracies"], (chosen_rewards > rejected_rewards).double().mean())
    torch.testing.assert_close(stats["rewards/margins"], (chosen_rewards - rejected_rewards).mean())
    assert 0.0 < stats["rewards/accuracies"] < 1.0  # the batch has pairs ranked either way


def test_one_pair_by_hand():
    # log pi(y_w) = -1, log pi(y_l) = -2, the reference -1.5 for both: h = 0.5 - (-0.5) = 1
    t = lambda x: torch.tensor([x], dtype=torch.float64)
    loss, stats = dpo_loss(t(-1.0), t(-2.0), t(-1.5), t(-1.5), beta=0.1)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.1)), abs=1e-15)  # -log sigmoid(0.1) = 0.64439...
    assert loss.item() == pytest.approx(0.6443966600735709, abs=1e-15)
    assert stats["rewards/chosen"].item() == pytest.approx(0.05) and stats["rewards/rejected"].item() == pytest.approx(-0.05)
    assert stats["rewards/margins"].item() == pytest.approx(0.1) and stats["rewards/accuracies"].item() == 1.0
    smoothed, _ = dpo_loss(t(-1.0), t(-2.0), t(-1.5), t(-1.5), beta=0.1, label_smoothing=0.25)
    assert smoothed.item() == pytest.approx(0.75 * math.log(1 + math.exp(-0.1)) + 0.25 * math.log(1 + math.exp(0.1)))
    ipo, _ = dpo_loss(t(-1.0), t(-2.0), t(-1.5), t(-1.5), beta=0.1, loss_type="ipo")
    assert ipo.item() == pytest.approx((1 - 5) ** 2)  # (h - 1/(2 beta))^2 = (1 - 5)^2


# ------------------------------------------------------------------------------------- the log-probs
def tiny_policy(tmp_path: Path, name: str = "policy") -> Path:
    return save_tiny_gpt2(tmp_path / name)


PAIRS = [("12+34=", "46", "4"), ("7+8=", "15 and more text", "x"), ("99+1=", "100", "1000000")]


def pair_items(path: Path, pairs=PAIRS):
    from tether.dpo.config import DataConfig
    from tether.dpo.data import encode_pairs
    from tether.hf import load_causal_lm, load_tokenizer
    from tether.inputs.pairs import PreferencePair
    from tether.sft.tokens import text_format

    tokenizer, model = load_tokenizer(path), load_causal_lm(path)
    fmt = text_format(DataConfig(), tokenizer, model, str(path))
    items, _ = encode_pairs(tokenizer, [PreferencePair(p, c, r) for p, c, r in pairs], fmt)
    return tokenizer, model, items


def plain_logps(model, tokenizer, prompt: str, reply: str) -> float:
    """The slow obvious way: prompt tokens, reply tokens and EOS as one unpadded sequence, one forward, log-softmax,
    the log-prob of each reply token (and EOS) gathered and summed."""
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt_ids + reply_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)  # (T, V)
    return sum(logp[len(prompt_ids) + k - 1, tok].item() for k, tok in enumerate(reply_ids))


@pytest.mark.parametrize("packing", [None, "rows"])
def test_reply_log_probs_equal_a_plain_forward_on_a_padded_batch(tmp_path, packing):
    from tether.dpo.data import forward_logps, pair_batch
    from tether.precision import Precision

    tokenizer, model, items = pair_items(tiny_policy(tmp_path))
    batch, segments = pair_batch(items, tokenizer, packing)
    if packing is None:  # padded: sequences of different lengths in one batch
        assert len({len(p.chosen.ids) for p in items} | {len(p.rejected.ids) for p in items}) > 2
        assert (batch.attention_mask == 0).any()
    model.eval()
    with torch.no_grad():
        got = forward_logps(model, batch, segments, 6, "cpu", Precision(torch.float32, "cpu"), average=False)
    expected = [plain_logps(model, tokenizer, p, c) for p, c, _ in PAIRS] + \
               [plain_logps(model, tokenizer, p, r) for p, _, r in PAIRS]
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=2e-5)
    # per-token means (IPO's): the same sums over the reply's tokens + EOS
    with torch.no_grad():
        means = forward_logps(model, batch, segments, 6, "cpu", Precision(torch.float32, "cpu"), average=True)
    lengths = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) + 1 for _, c, _ in PAIRS] + \
              [len(tokenizer(r, add_special_tokens=False)["input_ids"]) + 1 for _, _, r in PAIRS]
    torch.testing.assert_close(means.double(), torch.tensor(expected, dtype=torch.float64) / torch.tensor(lengths),
                               rtol=0, atol=2e-5)


def test_with_a_chat_template_only_the_assistant_reply_counts(tmp_path):
    """Through the chat template the reply is what follows the rendered generation prompt, plus EOS (the template ends
    the turn with none): computed here from the template's own renderings, one sequence at a time."""
    from tiny import make_llama_chat_dir

    from tether.dpo.data import forward_logps, pair_batch
    from tether.precision import Precision

    path = make_llama_chat_dir(tmp_path)
    tokenizer, model, items = pair_items(path)
    batch, segments = pair_batch(items, tokenizer, None)
    model.eval()
    with torch.no_grad():
        got = forward_logps(model, batch, segments, 6, "cpu", Precision(torch.float32, "cpu"), average=False)
    expected = []
    for side in (1, 2):
        for pair in PAIRS:
            user = [{"role": "user", "content": pair[0]}]
            prefix = list(tokenizer.apply_chat_template(user, tokenize=True, add_generation_prompt=True)["input_ids"])
            whole = list(tokenizer.apply_chat_template(user + [{"role": "assistant", "content": pair[side]}],
                                                       tokenize=True)["input_ids"]) + [tokenizer.eos_token_id]
            assert whole[:len(prefix)] == prefix
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([whole])).logits[0].double(), -1)
            expected.append(sum(logp[t - 1, whole[t]].item() for t in range(len(prefix), len(whole))))
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=2e-5)


def test_sequence_logps_by_hand():
    # one row, two sequences packed: [a b | c d e]; uniform logits over 4 tokens: every log-prob is log(1/4)
    logits = torch.zeros(1, 5, 4)
    labels = torch.tensor([[-100, 1, -100, 3, 2]])   # the second token of each sequence and the last one
    segments = torch.tensor([[0, 0, 1, 1, 1]])
    sums, counts = sequence_logps(logits, labels, segments, 2)
    assert counts.tolist() == [1, 2]
    torch.testing.assert_close(sums, torch.tensor([math.log(0.25), 2 * math.log(0.25)]))


def test_the_lora_reference_is_the_base_model_exactly(tmp_path):
    from tether.dpo.data import score_pairs
    from tether.hf import apply_lora, load_causal_lm
    from tether.precision import Precision

    path = tiny_policy(tmp_path)
    tokenizer, base, items = pair_items(path)
    torch.manual_seed(0)
    lora = apply_lora(load_causal_lm(path), 4, 16, 0.0, "all-linear")
    with torch.no_grad():  # a trained adapter: B away from its zero initialisation
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.add_(0.1 * torch.randn_like(p))
    args = (tokenizer, None, 2, "cpu", Precision(torch.float32, "cpu"), False)
    base_c, base_r = score_pairs(base, items, *args)
    ref_c, ref_r = score_pairs(lora, items, *args, adapter_off=True)
    assert torch.equal(ref_c, base_c) and torch.equal(ref_r, base_r)
    on_c, _ = score_pairs(lora, items, *args)
    assert (on_c - base_c).abs().min() > 1e-4  # the adapter itself changes every reply's log-prob


# ------------------------------------------------------------------------------------------- the CLI
def planted_pairs(path: Path, n: int = 60) -> Path:
    """Every prompt's chosen reply is "7777", its rejected one "3333": an easy preference to learn."""
    import random

    rng = random.Random(0)
    rows = [{"prompt": f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=", "chosen": "7777", "rejected": "3333"}
            for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.slow
def test_a_cli_run_learns_a_planted_preference(tmp_path, capsys):
    policy, data, out = tiny_policy(tmp_path), planted_pairs(tmp_path / "pairs.jsonl"), tmp_path / "dpo"
    code = main(["dpo", "--model", str(policy), "--data", str(data), "--output-dir", str(out), "--lr", "1e-3",
                 "--epochs", "2", "--batch-size", "8", "--eval-fraction", "0.2", "--progress", "false"])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    start, end = rows[0], rows[-1]
    assert start["step"] == 0 and end["step"] == 12
    # before training the policy is the reference: every margin 0, so no pair is ranked right
    assert start["eval/rewards/margins"] == 0.0 and start["eval/rewards/accuracies"] == 0.0
    assert end["eval/rewards/accuracies"] == end["eval/accuracy"] == 1.0 and end["eval/accuracy_low"] > 0.5
    assert end["eval/rewards/margins"] > 0.2 and end["eval/loss"] < math.log(2) - 0.1
    assert {"loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "grad_norm", "learning_rate"} <= set(rows[1])
    assert json.loads((out / "eval.json").read_text())["eval/rewards/accuracies"] == 1.0
    assert "held-out preference accuracy after training: 1.000" in capsys.readouterr().out
    from tether.hf import load_causal_lm

    load_causal_lm(out)  # the output is a policy


def test_a_bad_pairs_file_is_one_line_naming_file_and_row(tmp_path, capsys):
    policy, data = tiny_policy(tmp_path), planted_pairs(tmp_path / "pairs.jsonl", 10)
    lines = data.read_text().splitlines()
    lines[3] = json.dumps({"prompt": "1+1=", "chosen": "2"})  # no rejected reply
    data.write_text("\n".join(lines) + "\n")
    capsys.readouterr()  # what building the tiny policy printed
    code = main(["dpo", "--model", str(policy), "--data", str(data), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert f"{data}: line 4" in err and "rejected" in err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------- resume
KILLED_AT = 5  # steps 1-3 are epoch 1, 4-6 epoch 2: killed after the step-4 checkpoint, mid-epoch

KILL = """
import argparse, os, signal, sys
import tether
from tether.config import resolve_config
from tether.dpo.cli import add_arguments

class Kill(tether.Callback):
    def on_step_end(self, record):
        if record.step == {at}:
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up at all, as a crash

parser = argparse.ArgumentParser()
add_arguments(parser)
args = parser.parse_args(sys.argv[1:])
tether.DPOTrainer(resolve_config(tether.DPOConfig, args), callbacks=Kill()).train()
"""


def run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same kernels in every process
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--lora-r", "4", "--precompute-ref-log-probs", "false"]],
                         ids=["full-precomputed", "lora-adapter-off"])
def test_a_killed_and_resumed_run_equals_the_straight_run(tmp_path, extra):
    from tether.checkpoint import list_checkpoints

    policy, data = gpt2_with_dropout(tmp_path / "policy"), planted_pairs(tmp_path / "pairs.jsonl", 30)
    flags = lambda out: ["--model", str(policy), "--data", str(data), "--output-dir", str(out), "--epochs", "2",
                         "--batch-size", "8", "--lr", "1e-3", "--save-every", "2", "--eval-fraction", "0.2",
                         "--eval-every", "3", "--disable-dropout", "false", "--progress", "false", *extra]
    straight = run(["-m", "tether", "dpo", *flags(tmp_path / "straight")])
    assert straight.returncode == 0, straight.stderr[-2000:]
    out = tmp_path / "killed"
    killed = run(["-c", KILL.format(at=KILLED_AT), *flags(out)])
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [p.name for p in list_checkpoints(out)] == ["step_000004"]
    again = run(["-m", "tether", "dpo", *flags(out)])  # without --resume: refused, one line
    assert again.returncode == 2 and "holds an unfinished training run (step_000004); use --resume" in again.stderr
    resumed = run(["-m", "tether", "dpo", *flags(out), "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from step_000004: epoch 2, step 4" in resumed.stdout
    for name in ("model.safetensors", "metrics.jsonl", "eval.json"):
        assert (out / name).read_bytes() == (tmp_path / "straight" / name).read_bytes(), name
    assert not (out / "checkpoints").exists()


# ------------------------------------------------------------------------------------- the reference
@pytest.mark.slow
def test_a_precomputed_reference_and_one_scored_per_batch_train_the_same(tmp_path):
    """The reference's log-probs computed once before training, or by a frozen copy batch by batch as training goes
    (TRL's two ways), are the same numbers: the two runs end with the same weights up to float rounding."""
    from safetensors.torch import load_file

    import tether

    policy, data = tiny_policy(tmp_path), planted_pairs(tmp_path / "pairs.jsonl", 30)
    weights = {}
    for precompute in (True, False):
        out = tmp_path / f"run-{precompute}"
        # TRL's names, as a TRL script passes them: args= with DPOConfig's keys, model= and train_dataset= as paths
        result = tether.DPOTrainer(model=str(policy), train_dataset=str(data), args={
            "output_dir": str(out), "learning_rate": 1e-3, "per_device_train_batch_size": 8, "beta": 0.1,
            "precompute_ref_log_probs": precompute, "progress": False}).train()
        assert result.steps == 4 and result.models == {"policy": out}
        weights[precompute] = load_file(str(out / "model.safetensors"))
    start = load_file(str(policy / "model.safetensors"))
    for name, value in weights[True].items():
        torch.testing.assert_close(weights[False][name], value, rtol=0, atol=1e-5)
    assert any((weights[True][n] - start[n]).abs().max() > 1e-3 for n in start)  # it trained


def test_trl_arguments_that_do_not_apply_are_one_line(tmp_path):
    import tether
    from tether.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^DPOTrainer\(ref_model=\.\.\.\): the reference is the starting policy"):
        tether.DPOTrainer(model="policy", ref_model=object(), train_dataset="pairs.jsonl")
    with pytest.raises(ConfigError, match=r"label-smoothing: applies to --loss-type sigmoid, not ipo"):
        tether.DPOTrainer({"model.path": "p", "data.files": ["d"], "output_dir": "o", "loss_type": "ipo",
                           "label_smoothing": 0.1})


def test_callbacks_see_every_step_and_a_stop_finishes_with_the_policy_so_far(tmp_path):
    import tether

    policy, data = tiny_policy(tmp_path), planted_pairs(tmp_path / "pairs.jsonl", 30)
    seen = []

    class Watch(tether.Callback):
        def on_step_end(self, record):
            seen.append(record.step)
            if record.step == 2:
                raise tether.StopTraining("two is enough")
            return {"custom/margin_x2": 2 * record.metrics["rewards/margins"]}

        def on_evaluate(self, metrics):
            seen.append(("evaluate", metrics["eval/pairs"]))

        def on_save(self, path):
            seen.append(("save", Path(path).name))

    cfg = tether.DPOConfig(output_dir=str(tmp_path / "dpo"), progress=False, save_every=1)
    cfg.model.path, cfg.optim.lr = str(policy), 1e-3
    result = tether.DPOTrainer(cfg, pairs=str(data), callbacks=Watch()).train()
    assert result.stopped == "two is enough" and result.steps == 2
    assert seen == [1, ("save", "step_000001"), 2, ("evaluate", 3), ("save", "dpo")]
    rows = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "custom/margin_x2" in rows[1]
    assert rows[2]["eval/pairs"] == 3  # the run's last row carries the final evaluation
    assert json.loads((tmp_path / "dpo" / "tether_dpo.json").read_text())["run"]["stopped"] == "two is enough"
