#!/usr/bin/env python
"""Does a change leave PPO's numbers alone? Run three tiny GAE runs with whichever ``tether`` is imported and
record every metric (all but ``perf/*``) and SHA-256 digests of the final policy and critic weights; then compare
two such records.

The runs cover the paths most changes touch: a value head with held-out evaluation; LoRA with running reward
normalisation and 2 epochs; a separate critic with a warm-up step, the adaptive KL controller and gradient
accumulation. The same machine, torch and thread count give the same numbers bit for bit, so a difference is
the change's.

``--launch`` adds a fourth, launched run: 2 DDP trainers + 1 rollout process (``--rollout-processes 1``, the
transformers engine, CPU processes), synchronous; issue #41 used it to show that ``--async-rollout 0`` is the
disaggregated run of before bit for bit (its metrics rows may gain keys, listed by ``--compare``: every key of A
must be in B with A's value).

Usage (issue #31 used it to show that K = 1 with GAE is unchanged):
  git archive BASE | tar -x -C /tmp/base                      # the code before the change
  PYTHONPATH=/tmp/base python bench/same_numbers.py --out /tmp/base.json [--launch]
  python bench/same_numbers.py --out /tmp/new.json [--launch]
  python bench/same_numbers.py --compare /tmp/base.json /tmp/new.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
VARIANTS = {
    "head": dict(steps=4, eval__every=2, eval__n=8, data__eval_fraction=0.25, eval__at_start=True),
    "lora_running": dict(steps=4, model__lora_r=4, reward__normalize="running", ppo__epochs=2),
    "separate_warmup_adaptive": dict(steps=5, critic__kind="separate", critic__warmup_steps=1,
                                     kl__controller="adaptive", ppo__grad_accumulation=2),
}


def digest(files) -> str:
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(Path(f).read_bytes())
    return h.hexdigest()


def summary(run: Path) -> dict:
    """A run's metrics rows (``perf/*`` left out: seconds), and digests of its final policy and last critic."""
    rows = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = sorted((run / "checkpoints").iterdir())[-1]
    return {"rows": rows, "policy": digest((run / "policy").glob("*.safetensors")),
            "critic": digest(last.glob("critic.safetensors"))}


def launched(root: Path, policy: Path, prompts: Path, tether_dir: Path) -> Path:
    """The disaggregated run: ``accelerate launch`` of 3 CPU processes, 2 trainers + 1 rollout process, with the
    imported tether first on the path (run from an empty directory, so ``-m tether`` cannot find another)."""
    import os
    import subprocess

    out, work = root / "disaggregated", root / "cwd"
    work.mkdir()
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--num_processes", "3", "--main_process_port", "0",
           "-m", "tether", "ppo", "--policy", str(policy), "--prompts", str(prompts), "--reward",
           "tether.rules:char_share:char=7", "--gold", "none", "--output-dir", str(out), "--steps", "3",
           "--batch-size", "4", "--mini-batches", "2", "--max-new-tokens", "6", "--lr", "1e-3", "--progress",
           "false", "--rollout-processes", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(tether_dir), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"bench/same_numbers.py: the launched run failed:\n{done.stderr[-4000:]}")
    return out


def record(out: Path, launch: bool = False) -> None:
    sys.path.insert(0, str(TESTS))
    from tiny import make_policy_dir, make_prompts_file, tiny_config

    import tether
    from tether.ppo.train import train

    root = Path(tempfile.mkdtemp(prefix="same-numbers-"))
    policy, prompts = make_policy_dir(root), make_prompts_file(root)
    result = {"tether": tether.__file__}
    for name, overrides in VARIANTS.items():
        result[name] = summary(train(tiny_config(root / name, policy, prompts, **overrides)))
    if launch:
        result["disaggregated"] = summary(launched(root, policy, prompts, Path(tether.__file__).parents[1]))
    out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"{out}: {result['tether']}")


def compare(a_path: Path, b_path: Path) -> int:
    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    print(f"A: {a['tether']}\nB: {b['tether']}")
    same = True
    for name in [*VARIANTS, *(["disaggregated"] if "disaggregated" in a and "disaggregated" in b else [])]:
        rows_a, rows_b = a[name]["rows"], b[name]["rows"]
        # the tiny runs must match key for key; the launched one may gain keys (new diagnostics), A's must hold
        rows_same = rows_a == rows_b if name in VARIANTS else len(rows_a) == len(rows_b) and all(
            all(k in y and y[k] == v for k, v in x.items()) for x, y in zip(rows_a, rows_b))
        added = sorted({k for y in rows_b for k in y} - {k for x in rows_a for k in x})
        checks = {"rows": rows_same, **{key: a[name][key] == b[name][key] for key in ("policy", "critic")}}
        same &= all(checks.values())
        print(f"{name}: metrics {'same' if checks['rows'] else 'DIFFER'} ({len(rows_a)} rows), policy "
              f"{'same' if checks['policy'] else 'DIFFERS'}, critic {'same' if checks['critic'] else 'DIFFERS'}"
              + (f"; B adds {', '.join(added)}" if added else ""))
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="run the tiny runs and write their record here")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"), help="compare two records")
    ap.add_argument("--launch", action="store_true", help="also the launched disaggregated run (2 trainers + 1 "
                    "rollout process)")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        ap.error("give --out FILE or --compare A B")
    record(args.out, args.launch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
