#!/usr/bin/env python
"""TRL's SFTTrainer at the settings of ``tether sft`` (run by ``bench/sft_vs_trl.py`` with a TRL virtual environment's
python: ``python3 -m venv trl-venv && trl-venv/bin/pip install torch==2.13.0 && trl-venv/bin/pip install trl==1.16.0
torch==2.13.0``; TRL 1.16 installs transformers 5.25, accelerate 1.16).

The data comes tokenised by tether (``input_ids`` + ``completion_mask`` per sequence, JSONL) in the order tether's
run trains on them, so both trainers see the same tokens, the same loss mask and the same micro-batches: TRL reads
them in file order (a sequential sampler in place of its shuffling). Settings mapped to tether's: AdamW (lr, eps
1e-8, weight decay 0), a linear schedule to 0 at ``--steps`` with no warm-up, gradient-norm clip 1, fp32, no
gradient checkpointing (TRL's default is on), ``completion_only_loss`` (the mask is the loss mask), the loss over a
step's tokens (TRL divides by the step's ``num_items_in_batch``, as tether does), no evaluation, no saving;
``--padding-free`` is TRL's packing of the same micro-batches (``padding_free=True``: each micro-batch flattened
into one row with position ids). A step's time is from ``on_step_begin`` to ``on_step_end``: wall seconds, and the
process's CPU seconds (all threads), which a loaded machine disturbs far less.

usage: python trl_sft.py --model DIR --data DATA.jsonl --steps N --batch-size B --grad-accumulation G --lr LR
       [--padding-free] [--threads 2] --out result.json
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="JSONL of {input_ids, completion_mask} in training order")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--grad-accumulation", type=int, default=1)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--padding-free", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(a.threads)
    rows = [json.loads(line) for line in open(a.data, encoding="utf-8")]
    dataset = Dataset.from_list(rows)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(a.model)

    class InFileOrder(SFTTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    class Clock(TrainerCallback):
        def __init__(self):
            self.seconds, self.cpu_seconds, self.losses = [], [], []

        def on_step_begin(self, args, state, control, **kwargs):
            self.started, self.cpu_started = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.started)
            self.cpu_seconds.append(time.process_time() - self.cpu_started)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        config = SFTConfig(output_dir=tmp, max_steps=a.steps, per_device_train_batch_size=a.batch_size,
                           gradient_accumulation_steps=a.grad_accumulation, learning_rate=a.lr,
                           lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, adam_epsilon=1e-8,
                           max_grad_norm=1.0, gradient_checkpointing=False, bf16=False, fp16=False,
                           completion_only_loss=True, padding_free=a.padding_free, max_length=None,
                           logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[],
                           dataloader_drop_last=False, use_cpu=True, seed=0, disable_tqdm=True)
        trainer = InFileOrder(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                              callbacks=[clock])
        trainer.train()
    result = {"seconds_per_step": clock.seconds, "cpu_seconds_per_step": clock.cpu_seconds, "losses": clock.losses,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "trl": __import__("trl").__version__, "transformers": __import__("transformers").__version__}
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
