"""SFTTrainer (S1, S3): resume = the straight run bit for bit, gradient accumulation invariance, every trainable
parameter changed, callbacks, held-out loss against a slow reference, gold accuracy against the rule computed by hand
from the answers, LoRA exported merged or as an adapter, and the demo's SFT equal to its former loop bit for bit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tether
from tether.errors import ConfigError, TetherError
from tether.demo.task import build_policy, build_tokenizer, make_problems
from tiny import make_llama_chat_dir, make_policy_dir


def rows_file(root: Path, n: int = 48, seed: int = 0, name: str = "sft.jsonl") -> Path:
    path = root / name
    path.write_text("".join(json.dumps({"prompt": p["prompt"], "completion": p["answer"], "answer": p["answer"]}) + "\n"
                            for p in make_problems(n, seed=seed)), encoding="utf-8")
    return path


def config(root: Path, model: Path, data: Path, out: str = "out", **extra) -> dict:
    cfg = {"model": {"path": str(model)}, "data": {"files": [str(data)], "eval_fraction": 0.0},
           "output_dir": str(root / out), "progress": False, "save_every_minutes": 0,
           "optim": {"lr": 3e-3, "batch_size": 4, "max_steps": 6}}
    for key, value in extra.items():  # dotted keys
        cfg[key] = value
    return cfg


def weights(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    return make_policy_dir(root), rows_file(root)


@pytest.fixture(scope="module")
def llama_dropout(tmp_path_factory):
    """A Llama-shaped chat model with attention dropout 0.2: its training draws random numbers every step."""
    root = tmp_path_factory.mktemp("sft_llama")
    path = make_llama_chat_dir(root)
    cfg = json.loads((path / "config.json").read_text())
    cfg["attention_dropout"] = 0.2
    (path / "config.json").write_text(json.dumps(cfg))
    return path, rows_file(root)


class StopAt(tether.Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, record):
        if record.step == self.step:
            raise tether.StopTraining(f"stop at {self.step}")


@pytest.mark.parametrize("extra", [{}, {"model.lora_r": 4, "data.packing": True, "optim.schedule": "cosine",
                                        "optim.warmup_ratio": 0.3}], ids=["full", "lora_packed_cosine"])
def test_resume_equals_the_straight_run_bit_for_bit(llama_dropout, tmp_path, extra):
    model, data = llama_dropout
    extra = {**extra, "optim.grad_accumulation": 2, "model.export_lora": "adapter" if extra else "merged"}
    straight = tether.SFTTrainer(config(tmp_path, model, data, "straight", **extra)).train()
    stopped = tether.SFTTrainer(config(tmp_path, model, data, "resumed", **extra), callbacks=[StopAt(2)]).train()
    assert stopped.stopped == "stop at 2" and stopped.steps == 2
    assert (tmp_path / "resumed" / "checkpoints").is_dir()  # a stopped run keeps its checkpoint
    resumed = tether.SFTTrainer(config(tmp_path, model, data, "resumed", **extra), resume=True).train()
    assert resumed.steps == straight.steps == 6 and not (tmp_path / "resumed" / "checkpoints").exists()
    a, b = weights(straight.run_dir), weights(resumed.run_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()]
    straight_rows = [json.loads(line) for line in (straight.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["sft/loss"] for r in rows] == [r["sft/loss"] for r in straight_rows]


def test_a_different_setting_cannot_resume_and_a_full_directory_needs_resume(tiny, tmp_path):
    model, data = tiny
    tether.SFTTrainer(config(tmp_path, model, data), callbacks=[StopAt(1)]).train()
    with pytest.raises(TetherError, match=r"holds an unfinished run; use --resume"):
        tether.SFTTrainer(config(tmp_path, model, data))
    with pytest.raises(TetherError, match=r"^--resume: optim.lr is 0.1 but the run in .* was made with 0.003"):
        tether.SFTTrainer(config(tmp_path, model, data, **{"optim.lr": 0.1}), resume=True)


def test_gradient_accumulation_and_batch_size_cut_the_same_step_alike(tiny, tmp_path):
    model, data = tiny
    one = tether.SFTTrainer(config(tmp_path, model, data, "one", **{"optim.batch_size": 8, "optim.max_steps": 3}))
    eight = tether.SFTTrainer(config(tmp_path, model, data, "eight", **{"optim.batch_size": 2,
                                                                         "optim.grad_accumulation": 4,
                                                                         "optim.max_steps": 3}))
    losses = [(one.step().metrics["sft/loss"], eight.step().metrics["sft/loss"]) for _ in range(3)]
    assert all(abs(a - b) < 1e-5 for a, b in losses)
    a, b = dict(one.model.named_parameters()), dict(eight.model.named_parameters())
    assert max(float((a[k] - b[k]).abs().max().detach()) for k in a) < 1e-5


def test_every_trainable_parameter_changes_and_callbacks_see_the_run(tiny, tmp_path):
    model, data = tiny
    events = []

    class Watch(tether.Callback):
        def on_step_end(self, record):
            events.append(("step", record.step))
            return {"custom/twice_loss": 2 * record.metrics["sft/loss"]}

        def on_evaluate(self, metrics):
            events.append(("evaluate", round(metrics["eval/loss"], 6)))

        def on_save(self, path):
            events.append(("save", Path(path).name))

    before = load_file(str(model / "model.safetensors"))
    result = tether.SFTTrainer(config(tmp_path, model, data, **{"data.eval_fraction": 0.25, "save_every": 3,
                                                                 "eval.gold": "none"}),
                               callbacks=[Watch()]).train()
    after = weights(result.run_dir)
    assert all(not torch.equal(before[k], after[k]) for k in before if k in after)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["custom/twice_loss"] == 2 * r["sft/loss"] for r in rows)
    # a checkpoint at step 3; none at the last step (the policy is written then, nothing is left to resume)
    assert [e for e in events if e[0] == "save"] == [("save", "step_000003"), ("save", "out")]
    assert ("evaluate", round(rows[-1]["eval/loss"], 6)) in events and "eval/loss" not in rows[0]
    assert result.metrics["eval/perplexity"] == pytest.approx(math.exp(result.metrics["eval/loss"]))


def test_held_out_loss_equals_a_sequence_by_sequence_reference(tiny, tmp_path):
    from tether.sft.evaluate import held_out_loss

    model, data = tiny
    trainer = tether.SFTTrainer(config(tmp_path, model, data, **{"data.eval_fraction": 0.25, "data.packing": True,
                                                                  "eval.batch_size": 5}))
    run, total, count = trainer.run, 0.0, 0
    with torch.no_grad():
        for e in run.held_out:  # one sequence at a time, no padding, no packing
            logp = torch.log_softmax(trainer.model(input_ids=torch.tensor([e.ids])).logits[0].double(), -1)
            for t in range(1, len(e.ids)):
                if e.labels[t] != -100:
                    total, count = total - float(logp[t - 1, e.labels[t]]), count + 1
    metrics = held_out_loss(run, 5)
    assert metrics["eval/tokens"] == count and metrics["eval/loss"] == pytest.approx(total / count, abs=1e-5)


def recording_rule(log):
    def judge(prompts, responses, answer=None, ended_with_eos=None):
        log.append((list(responses), list(ended_with_eos)))
        return [1.0 if r.startswith(a[:1]) and e else 0.0 for r, a, e in zip(responses, answer, ended_with_eos)]
    return judge


def test_gold_accuracy_is_the_rule_on_the_greedy_answers(tiny, tmp_path):
    model, data = tiny
    calls = []
    trainer = tether.SFTTrainer(config(tmp_path, model, data, **{"data.eval_fraction": 0.25, "eval.at_start": True,
                                                                  "eval.max_new_tokens": 4, "eval.samples": 99}),
                                gold=recording_rule(calls))
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (trainer.run_dir / "samples" / "step_0.jsonl").read_text().splitlines()]
    responses = [r for batch, _ in calls for r in batch]
    assert [s["response"] for s in samples] == responses and all(flags for _, flags in calls)
    answers = [r["answer"] for r in trainer.run.eval_rows]
    by_hand = [int(r.startswith(a[:1]) and not s["truncated"]) for r, a, s in zip(responses, answers, samples)]
    assert rows[0]["step"] == 0 and rows[0]["eval/correct"] == "".join(map(str, by_hand))
    assert rows[0]["eval/accuracy"] == sum(by_hand) / len(by_hand) and rows[0]["eval/prompts"] == len(answers)
    assert trainer.cfg.eval.gold == "python:judge"


def test_lora_exports_merged_or_the_adapter(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, data = tiny
    merged = tether.SFTTrainer(config(tmp_path, model, data, "merged", **{"model.lora_r": 4})).train()
    adapter = tether.SFTTrainer(config(tmp_path, model, data, "adapter", **{"model.lora_r": 4,
                                                                            "model.export_lora": "adapter"})).train()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    plain = AutoModelForCausalLM.from_pretrained(merged.run_dir).eval()
    over_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), adapter.run_dir).eval()
    assert (adapter.run_dir / "adapter_config.json").is_file() and not (merged.run_dir / "adapter_config.json").exists()
    with torch.no_grad():  # the same seed and data: the same adapter, merged or not
        assert torch.allclose(plain(ids).logits, over_base(ids).logits, atol=1e-5)
    assert (merged.run_dir / "tokenizer.json").is_file() and (adapter.run_dir / "tokenizer.json").is_file()


def test_conversations_from_a_dataset_on_a_chat_model(tmp_path):
    datasets = pytest.importorskip("datasets")
    from transformers import AutoTokenizer

    model = make_llama_chat_dir(tmp_path)
    rows = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": f"{i}+1="},
                                                     {"role": "assistant", "content": str(i + 1)}]} for i in range(12)])
    result = tether.SFTTrainer({"model": {"path": str(model)}, "output_dir": str(tmp_path / "out"), "progress": False,
                                "data": {"eval_fraction": 0.25}, "optim": {"batch_size": 4, "epochs": 2}},
                               train_data=rows).train()
    assert result.steps == 6 and result.metrics["eval/tokens"] > 0  # 9 train rows: 3 micro-batches an epoch
    saved = AutoTokenizer.from_pretrained(result.run_dir)
    assert saved.chat_template == AutoTokenizer.from_pretrained(model).chat_template
    meta = json.loads((result.run_dir / "tether_sft.json").read_text())
    assert meta["data"]["format"] == "chat" and meta["training"]["data"]["files"] == ["python:train_data"]


def former_demo_sft(model, tokenizer, problems, steps, batch_size, lr, seed, weight_decay=0.01):
    """The demo's SFT loop as it was before it ran through SFTTrainer (commit 1d9fc17), for the parity test."""
    import torch.nn.functional as F

    prompts = [tokenizer(p["prompt"], add_special_tokens=False)["input_ids"] for p in problems]
    answers = [tokenizer(p["answer"], add_special_tokens=False)["input_ids"] for p in problems]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    width = max(len(p) + len(a) + 1 for p, a in zip(prompts, answers))
    ids = torch.tensor([p + a + [eos] + [pad] * (width - len(p) - len(a) - 1) for p, a in zip(prompts, answers)])
    mask = (torch.arange(width)[None] < torch.tensor([len(p) + len(a) + 1 for p, a in zip(prompts, answers)])[:, None])
    labels = torch.tensor([[-100] * len(p) + a + [eos] + [-100] * (width - len(p) - len(a) - 1)
                           for p, a in zip(prompts, answers)])
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.train()
    order, cursor = torch.randperm(len(problems), generator=gen), 0
    for _ in range(steps):
        if cursor + batch_size > len(problems):
            order, cursor = torch.randperm(len(problems), generator=gen), 0
        idx = order[cursor:cursor + batch_size]
        cursor += batch_size
        w = int(mask[idx].sum(1).max())
        logits = model(input_ids=ids[idx, :w], attention_mask=mask[idx, :w].long()).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[idx, 1:w].reshape(-1),
                               ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


def test_the_demos_sft_equals_its_former_loop_bit_for_bit():
    from tether.demo.sft import sft_train

    tok = build_tokenizer()
    problems = make_problems(70, seed=4)
    old, new = (build_policy(tok, seed=1, n_layer=2, n_embd=32, n_head=2) for _ in range(2))
    former_demo_sft(old, tok, problems, steps=9, batch_size=16, lr=3e-3, seed=2)  # 4 batches an epoch, tail dropped
    stats = sft_train(new, tok, problems, steps=9, batch_size=16, lr=3e-3, seed=2, progress=False)
    assert stats["steps"] == 9
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), new.state_dict().values()))


def test_sft_trainer_is_lazy_and_import_stays_light():
    import subprocess
    import sys

    from tether.sft.config import SFTConfig
    from tether.sft.train import SFTTrainer

    code = "import sys, tether; tether.SFTConfig; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False" and tether.SFTTrainer is SFTTrainer and tether.SFTConfig is SFTConfig


@pytest.mark.parametrize("lora", [0, 4])
def test_bf16_computes_with_fp32_masters_and_exports_bf16(tiny, tmp_path, lora):
    model, data = tiny
    trainer = tether.SFTTrainer(config(tmp_path, model, data, **{"model.dtype": "bf16", "model.lora_r": lora,
                                                                  "optim.max_steps": 2}))
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)  # the masters
    assert all(p.dtype == torch.bfloat16 for p in frozen) and (len(frozen) > 0) == bool(lora)  # a LoRA base
    result = trainer.train()
    assert math.isfinite(result.metrics["sft/loss"])
    saved = weights(result.run_dir)
    assert all(v.dtype == torch.bfloat16 for v in saved.values() if v.is_floating_point())
    assert json.loads((result.run_dir / "config.json").read_text())["dtype"] == "bfloat16"


def test_non_finite_steps_are_skipped_and_stop_the_run_after_three(tiny, tmp_path, monkeypatch):
    import tether.sft.step as step_mod

    model, data = tiny
    real = step_mod.token_nll
    monkeypatch.setattr(step_mod, "token_nll", lambda logits, labels: (real(logits, labels)[0] * math.nan,
                                                                       real(logits, labels)[1]))
    alerts = []

    class Alerts(tether.Callback):
        def on_alert(self, alert):
            alerts.append(alert)

    trainer = tether.SFTTrainer(config(tmp_path, model, data), callbacks=[Alerts()])
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.step()
    trainer.step()
    with pytest.raises(TetherError, match=r"^step 3: 3 consecutive steps with a non-finite loss or gradient"):
        trainer.step()
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())  # no update applied
    assert len(alerts) == 3 and "update skipped" in alerts[0]
    rows = [json.loads(line) for line in (trainer.run_dir / "alerts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_trackers_get_the_rows_and_their_files_stay_in_the_policy_directory(tiny, tmp_path):
    pytest.importorskip("tensorboard", reason="pip install tensorboard (the [test] extra has it)")
    model, data = tiny
    result = tether.SFTTrainer(config(tmp_path, model, data, **{"log_with": ["tensorboard"],
                                                                 "optim.max_steps": 2})).train()
    events = list((result.run_dir / "tether").rglob("events.out.tfevents.*"))
    assert events and (result.run_dir / "model.safetensors").is_file()


def test_objects_from_python_are_named_and_must_come_again_to_resume(tiny, tmp_path):
    model, data = tiny
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    cfg = config(tmp_path, model, data)
    with pytest.raises(ConfigError, match=r"^data.files .*sft.jsonl: train_data= was given from Python as well"):
        tether.SFTTrainer(cfg, train_data=rows)
    cfg["data"]["files"] = []
    tether.SFTTrainer(cfg, train_data=rows, callbacks=[StopAt(1)]).train()
    saved = str(tmp_path / "out" / "config.yaml")
    with pytest.raises(ConfigError, match=r"^data.files python:train_data: was given from Python; give it again "
                                          r"\(SFTTrainer\(\.\.\., train_data=\.\.\.\)\)"):
        tether.SFTTrainer(saved, resume=True)
    assert tether.SFTTrainer(saved, train_data=rows, resume=True).train().steps == 6
