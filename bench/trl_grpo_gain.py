#!/usr/bin/env python
"""TRL's GRPOTrainer on recipe 4's task until its held-out gold is up (the TRL side of bench/time_to_gain.py; runs in
TRL's own venv, with reasoning-gym and this repository on its path for the task's check).

The task rows are the ones bench/time_to_gain.py writes (tether's split: the same training and held-out problems
as tether's run). The reward is reasoning-gym's own check of the reply's final answer, through the same function
tether's run uses (``tether.tasks.reasoning_gym_score``, 0 for a reply cut at the length cap). The settings are
TRL's own defaults except where this CPU or recipe 4's task needs otherwise, each said in ``grpo_config`` (peers'
README, "TRL 1.16 GRPOTrainer on a real model").

Every ``--eval-every`` generation batches (and before the first) the policy answers the held-out problems greedily
(``model.generate``, left-padded batches, the same chat prompt and length cap); each evaluation's per-problem 0/1
(``correct``, in held-out order) and the training seconds so far (wall time inside ``train()``, evaluations left
out) are one JSON line of ``--out``. With ``--stop-at-gain`` the run stops at the first evaluation ``+POINTS`` over
step 0 with McNemar p < 0.01 (tether.core.stats' test, copied: this venv has no tether dependencies).

    TRL_VENV/bin/python bench/trl_grpo_gain.py --model DIR --rows DIR --out evals.jsonl [--steps 20 --eval-every 2]
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tether.tasks: the task's check (import tether loads torch only)


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p (as tether.core.stats.mcnemar_exact)."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    return min(1.0, 2.0 * sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2.0**n)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def chat(row: dict, system_prompt: str) -> list[dict]:
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [{"role": "user", "content": row["prompt"]}]


def grpo_config(a, out_dir: str):
    """TRL 1.16's GRPOConfig: its defaults, except those named here (each with its reason)."""
    from trl import GRPOConfig

    prompts, k, optimizer_steps = a.prompts_per_step, a.num_generations, a.optimizer_steps
    return GRPOConfig(
        output_dir=out_dir,
        # recipe 4's batch: 8 prompts x K 8 a generation batch, two optimizer steps over it
        num_generations=k,
        per_device_train_batch_size=prompts * k // optimizer_steps,
        steps_per_generation=optimizer_steps,
        max_steps=a.steps * optimizer_steps,
        max_completion_length=a.max_new_tokens,  # the task's answers are short (recipe 4: 64)
        temperature=a.temperature,               # SmolLM2's sampled pass rate: 18% at 0.7, 7% at TRL's 1.0
        learning_rate=a.lr,                      # a LoRA learning rate (TRL's 1e-6 is a full fine-tune's)
        bf16=a.bf16,                             # TRL's default; on a CPU without bf16 units it is emulated
        use_cpu=True,
        logging_strategy="no", report_to="none", disable_tqdm=True, save_strategy="no", eval_strategy="no",
        remove_unused_columns=False, seed=a.seed,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="policy directory (SmolLM2-135M-Instruct)")
    p.add_argument("--rows", required=True, help="folder with train.jsonl and heldout.jsonl (tether's split)")
    p.add_argument("--out", required=True, help="JSONL: one line per evaluation")
    p.add_argument("--steps", type=int, default=20, help="generation batches at most")
    p.add_argument("--eval-every", type=int, default=2, help="generation batches between evaluations")
    p.add_argument("--stop-at-gain", type=float, default=0.10, help="stop at +this over step 0 with p < 0.01 (0: no)")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--optimizer-steps", type=int, default=2, help="optimizer steps a generation batch")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--bf16", action="store_true", help="TRL's default bf16 (off: fp32, as tether's recipe 4)")
    p.add_argument("--system-prompt", default="Answer briefly. End your reply with 'The answer is X.'")
    p.add_argument("--eval-batch", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOTrainer

    from tether.tasks import reasoning_gym_score

    hf_logging.set_verbosity_error()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    rows = Path(a.rows)
    train, held = read_rows(rows / "train.jsonl"), read_rows(rows / "heldout.jsonl")
    columns = ("answer", "rg_task", "rg_metadata")
    dataset = Dataset.from_list([{"prompt": chat(r, a.system_prompt), "question": r["prompt"],
                                  **{c: r[c] for c in columns}} for r in train])
    tokenizer = AutoTokenizer.from_pretrained(a.model, padding_side="left")

    def gold(prompts, completions, completion_ids, question, answer, rg_task, rg_metadata, **_):
        """The task's check, as tether's run scores it (a reply without EOS was cut: 0)."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        ended = [tokenizer.eos_token_id in ids for ids in completion_ids]
        return reasoning_gym_score(question, texts, answer, rg_task, rg_metadata, ended_with_eos=ended)

    def evaluate(model) -> str:
        was_training = model.training
        model.eval()
        correct = []
        for i in range(0, len(held), a.eval_batch):
            batch = held[i:i + a.eval_batch]
            texts = [tokenizer.apply_chat_template(chat(r, a.system_prompt), tokenize=False,
                                                   add_generation_prompt=True) for r in batch]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=a.max_new_tokens, do_sample=False, use_cache=True,
                                     pad_token_id=tokenizer.pad_token_id)
            new = out[:, enc["input_ids"].shape[1]:]
            replies = tokenizer.batch_decode(new, skip_special_tokens=True)
            ended = [tokenizer.eos_token_id in ids.tolist() for ids in new]
            scores = reasoning_gym_score([r["prompt"] for r in batch], replies, [r["answer"] for r in batch],
                                        [r["rg_task"] for r in batch], [r["rg_metadata"] for r in batch],
                                        ended_with_eos=ended)
            correct += ["1" if s >= 1.0 else "0" for s in scores]
        model.train(was_training)
        return "".join(correct)

    out = open(a.out, "w", encoding="utf-8")
    clock = {"start": None, "eval": 0.0, "base": None}

    def record(model, step: int) -> bool:
        """Evaluate, write the line; True when the gain is reached."""
        t = time.perf_counter()
        seconds = t - clock["start"] - clock["eval"] if clock["start"] else 0.0  # earlier evaluations left out
        correct = evaluate(model)
        clock["eval"] += time.perf_counter() - t
        base = clock["base"] = clock["base"] or correct
        gained = sum(x == "1" and y == "0" for x, y in zip(correct, base))
        lost = sum(x == "0" and y == "1" for x, y in zip(correct, base))
        line = {"step": step, "train_seconds": seconds, "accuracy": correct.count("1") / len(correct),
                "gained": gained, "lost": lost, "p": mcnemar_exact(gained, lost), "correct": correct}
        out.write(json.dumps(line) + "\n")
        out.flush()
        print(f"trl step {step}: {100 * line['accuracy']:.0f}% (+{gained}/-{lost}, p {line['p']:.2g}) after "
              f"{seconds:.0f} training s", flush=True)
        return a.stop_at_gain > 0 and (gained - lost) / len(correct) >= a.stop_at_gain and line["p"] < 0.01

    class EvalEvery(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            clock["start"] = None
            record(model, 0)
            clock["start"], clock["eval"] = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % (a.optimizer_steps * a.eval_every) == 0:
                if record(model, state.global_step // a.optimizer_steps):
                    control.should_training_stop = True

    lora = LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, target_modules="all-linear", task_type="CAUSAL_LM")
    with tempfile.TemporaryDirectory(prefix="trl_grpo_gain_") as work:
        trainer = GRPOTrainer(model=a.model, reward_funcs=gold, args=grpo_config(a, work), train_dataset=dataset,
                              processing_class=tokenizer, peft_config=lora, callbacks=[EvalEvery()])
        trainer.train()
    out.close()


if __name__ == "__main__":
    main()
