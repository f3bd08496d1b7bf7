#!/usr/bin/env python
"""Does a change leave PPO's numbers alone? Run three tiny GAE runs with whichever ``tether`` is imported and
record every metric (all but ``perf/*``) and SHA-256 digests of the final policy and critic weights; then compare
two such records.

The runs cover the paths most changes touch: a value head with held-out evaluation; LoRA with running reward
normalisation and 2 epochs; a separate critic with a warm-up step, the adaptive KL controller and gradient
accumulation. The same machine, torch and thread count give the same numbers bit for bit, so a difference is
the change's.

Usage (issue #31 used it to show that K = 1 with GAE is unchanged):
  git archive BASE | tar -x -C /tmp/base                      # the code before the change
  PYTHONPATH=/tmp/base python bench/same_numbers.py --out /tmp/base.json
  python bench/same_numbers.py --out /tmp/new.json
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


def record(out: Path) -> None:
    sys.path.insert(0, str(TESTS))
    from tiny import make_policy_dir, make_prompts_file, tiny_config

    import tether
    from tether.ppo.train import train

    root = Path(tempfile.mkdtemp(prefix="same-numbers-"))
    policy, prompts = make_policy_dir(root), make_prompts_file(root)
    result = {"tether": tether.__file__}
    for name, overrides in VARIANTS.items():
        run = train(tiny_config(root / name, policy, prompts, **overrides))
        rows = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
                for line in (run / "metrics.jsonl").read_text().splitlines()]
        last = sorted((run / "checkpoints").iterdir())[-1]
        result[name] = {"rows": rows, "policy": digest((run / "policy").glob("*.safetensors")),
                        "critic": digest(last.glob("critic.safetensors"))}
    out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"{out}: {result['tether']}")


def compare(a_path: Path, b_path: Path) -> int:
    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    print(f"A: {a['tether']}\nB: {b['tether']}")
    same = True
    for name in VARIANTS:
        checks = {key: a[name][key] == b[name][key] for key in ("rows", "policy", "critic")}
        same &= all(checks.values())
        print(f"{name}: metrics {'same' if checks['rows'] else 'DIFFER'} ({len(a[name]['rows'])} rows), policy "
              f"{'same' if checks['policy'] else 'DIFFERS'}, critic {'same' if checks['critic'] else 'DIFFERS'}")
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="run the tiny runs and write their record here")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"), help="compare two records")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        ap.error("give --out FILE or --compare A B")
    record(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
