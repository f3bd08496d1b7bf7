#!/usr/bin/env python
"""Time to a held-out gain (#53 item 5): wall seconds of training until held-out gold is +10 points over step 0
(McNemar p < 0.01), tether's recipe 4 against TRL's GRPOTrainer on the same problems, seed by seed.

Both sides get the same 100 training and 100 held-out chain_sum problems (tether's split, written once), the same
chat prompt, the same check of the reply's final answer (reasoning-gym's, through ``tether.tasks``) and greedy
held-out evaluations every ``--eval-every`` generation batches, from step 0. Each run is a fresh process; the runs
alternate tether, TRL, tether, ... Training seconds are the wall time of the training loop with the evaluations left
out (and the set-up before the first step: loading models, starting the engine, which each side reports apart).
tether runs ``--config`` (recipe 4: GRPO, dynamic sampling, curriculum, packing, vLLM, fp32); TRL runs
bench/trl_grpo_gain.py (TRL 1.16's defaults but the batch, length cap, temperature, LoRA and its learning rate, which
recipe 4's task sets; fp32 unless ``--trl-bf16``). A run stops at its first evaluation with the gain.

    python bench/time_to_gain.py --trl-python TRL_VENV/bin/python [--seeds 0 1 2] [--steps 20] [--eval-every 2]

TRL's venv: ``python3 -m venv trl-venv && trl-venv/bin/pip install torch==2.13.0 && trl-venv/bin/pip install
trl==1.16.0 peft reasoning-gym==0.1.25 torch==2.13.0``. Printed: per seed and tool the evaluations (accuracy,
gained / lost, p, training seconds), the seconds to the gain, and TRL / tether.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tether.core.stats import mcnemar_exact  # noqa: E402


def paired_line(step: int, seconds: float, correct: str, base: str) -> dict:
    gained = sum(x == "1" and y == "0" for x, y in zip(correct, base))
    lost = sum(x == "0" and y == "1" for x, y in zip(correct, base))
    return {"step": step, "train_seconds": seconds, "accuracy": correct.count("1") / len(correct), "gained": gained,
            "lost": lost, "p": mcnemar_exact(gained, lost), "correct": correct}


def reached(line: dict, gain: float) -> bool:
    return (line["gained"] - line["lost"]) / len(line["correct"]) >= gain and line["p"] < 0.01


def run_tether(config: str, engine: str, seed: int, steps: int, eval_every: int, eval_n: int, gain: float,
               out: Path, run_dir: Path) -> None:
    """One tether run (this process): recipe 4 from ``config``, stopped at the gain; a JSON line per evaluation."""
    from tether.config import check_config, load_yaml
    from tether.ppo.config import RunConfig
    from tether.ppo.train import PPOTrainer
    from tether.runlog import read_jsonl_rows

    cfg = RunConfig()
    load_yaml(cfg, config)
    cfg.seed, cfg.steps, cfg.output_dir, cfg.generation.engine = seed, steps, str(run_dir), engine
    cfg.eval.every, cfg.eval.at_start, cfg.progress = eval_every, True, False
    cfg.eval.n = eval_n or cfg.eval.n
    t = time.perf_counter()
    trainer = PPOTrainer(check_config(cfg))  # models, the engine, the step-0 evaluation
    setup = time.perf_counter() - t
    row0 = next(r for r in read_jsonl_rows(run_dir / "metrics.jsonl") if r["step"] == 0)
    base, training = row0["eval/correct"], 0.0
    lines = [{**paired_line(0, 0.0, base, base), "setup_seconds": setup - row0.get("perf/seconds_eval", 0.0)}]
    with open(out, "w", encoding="utf-8") as f:
        f.write(json.dumps(lines[0]) + "\n")
        for _ in range(steps):
            t = time.perf_counter()
            row = trainer.step().metrics
            training += time.perf_counter() - t - row.get("perf/seconds_eval", 0.0)
            if "eval/correct" in row:
                line = paired_line(row["step"], training, row["eval/correct"], base)
                f.write(json.dumps(line) + "\n")
                f.flush()
                print(f"tether step {line['step']}: {100 * line['accuracy']:.0f}% (+{line['gained']}/-{line['lost']}, "
                      f"p {line['p']:.2g}) after {training:.0f} training s", flush=True)
                if reached(line, gain):
                    break
    trainer.finish()


def write_rows(config: str, eval_n: int, d: Path) -> None:
    """tether's split of ``config``'s task (the rows its run trains and evaluates on), for TRL."""
    from tether.config import load_yaml
    from tether.ppo.config import RunConfig
    from tether.tasks import split_rows

    cfg = RunConfig()
    load_yaml(cfg, config)
    train, held = split_rows(cfg.data.prompts, cfg.data.task_train, cfg.data.task_eval, cfg.data.task_seed)
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", held[:eval_n or cfg.eval.n])):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def first_gain(lines: list[dict], gain: float) -> dict | None:
    return next((x for x in lines if x["step"] > 0 and reached(x, gain)), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trl-python", default="", help="python of TRL's venv ('' = tether only)")
    p.add_argument("--config", default=str(REPO / "examples" / "recipe4-grpo-chain-sum.yaml"))
    p.add_argument("--engine", default="vllm")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--gain", type=float, default=0.10)
    p.add_argument("--eval-n", type=int, default=0, help="held-out problems evaluated (0 = the config's: all 100)")
    p.add_argument("--trl-bf16", action="store_true")
    p.add_argument("--work", default="", help="folder for the runs ('' = a temporary one)")
    p.add_argument("--tether-run", nargs=2, metavar=("SEED", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="time_to_gain_"))
    work.mkdir(parents=True, exist_ok=True)
    if a.tether_run:
        seed, out = int(a.tether_run[0]), Path(a.tether_run[1])
        run_tether(a.config, a.engine, seed, a.steps, a.eval_every, a.eval_n, a.gain, out, out.with_suffix(""))
        return
    from tether.presets import resolve_model_path

    write_rows(a.config, a.eval_n, work)
    model = resolve_model_path("smollm2-135m-instruct", what="policy")
    results: dict = {}
    for i, seed in enumerate(a.seeds):
        tools = ["tether", "trl"] if a.trl_python else ["tether"]
        for tool in tools if i % 2 == 0 else tools[::-1]:
            out = work / f"{tool}_s{seed}.jsonl"
            if tool == "tether":
                cmd = [sys.executable, __file__, "--config", a.config, "--engine", a.engine, "--steps", str(a.steps),
                       "--eval-every", str(a.eval_every), "--eval-n", str(a.eval_n), "--gain", str(a.gain),
                       "--work", str(work),
                       "--tether-run", str(seed), str(out)]
            else:
                cmd = [a.trl_python, str(REPO / "bench" / "trl_grpo_gain.py"), "--model", str(model), "--rows",
                       str(work), "--out", str(out), "--steps", str(a.steps), "--eval-every", str(a.eval_every),
                       "--stop-at-gain", str(a.gain), "--seed", str(seed)] + (["--bf16"] if a.trl_bf16 else [])
            print(f"== {tool}, seed {seed}: {' '.join(cmd)}", flush=True)
            subprocess.run(cmd, check=True)
            results[(tool, seed)] = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    print(f"\nheld-out gold at each evaluation, against step 0 (McNemar); the first with +{100 * a.gain:.0f} points "
          "and p < 0.01 in bold\n")
    print("| tool | seed | evaluations: step, accuracy (+gained/−lost, p), training s | seconds to the gain |")
    print("| --- | --- | --- | --- |")
    to_gain: dict = {}
    for (tool, seed), lines in results.items():
        hit = first_gain(lines, a.gain)
        to_gain[(tool, seed)] = hit["train_seconds"] if hit else None
        shown = "; ".join(("**" if x is hit else "") + f"{x['step']}: {100 * x['accuracy']:.0f}% (+{x['gained']}/"
                          f"−{x['lost']}, p {x['p']:.2g}), {x['train_seconds']:.0f} s" + ("**" if x is hit else "")
                          for x in lines)
        seconds = f"{hit['train_seconds']:.0f} s" if hit else "not reached"
        print(f"| {tool} | {seed} | {shown} | {seconds} |")
    ratios = [to_gain[("trl", s)] / to_gain[("tether", s)] for s in a.seeds
              if to_gain.get(("trl", s)) and to_gain.get(("tether", s))]
    if ratios:
        print(f"\nTRL / tether, seconds to the gain: median {statistics.median(ratios):.2f}× "
              f"({', '.join(f'{r:.2f}' for r in ratios)}; > 1: tether is faster)")
    print(f"\nruns in {work}")


if __name__ == "__main__":
    main()
