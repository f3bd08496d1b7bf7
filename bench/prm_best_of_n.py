"""Process vs outcome reward models on the step task (A9, issue #17): Best-of-N, then a short PPO run.

    python bench/prm_best_of_n.py --out runs/prm_bon --seed 0

1. SFT the demo's tiny policy on the step task (``tether.demo.steps``: running sums, steps separated by a
   space) until its greedy dev accuracy reaches ``--sft-target``;
2. continue SFT on a copy for ``--verifier-sft-steps`` more steps: the reward models' backbone, a verifier
   stronger than the generator (measured: from the policy's own backbone, PRM and ORM both learned how hard
   a prompt is, not whether a reply is right, and picked worse than at random);
3. sample ``--k`` responses for each of ``--label-prompts`` train prompts and label them twice: every step
   by the step rule (``step_labels``, through the converter ``label_with_rule``) for the PRM, and the
   whole response by the gold rule for the ORM — the same samples, the same backbone, the same trainer
   (``train-rm --process``; the ORM is the one-step case, read at an appended ``[EOS]``);
4. Best-of-N on held-out prompts: ``--n`` samples each from the SFT policy, one picked by the PRM (highest
   minimum step probability) and one by the ORM (highest outcome probability); gold accuracy of each with
   Wilson intervals, beside greedy, a random pick (the mean sample), the majority vote and the votes
   weighted by each model's scores, and the oracle (pass@N), and a paired McNemar test PRM vs ORM; beside
   them, the demo's outcome-RM recipe (Bradley–Terry on right ≻ wrong pairs of the same samples);
5. a short PPO run from the SFT policy against the PRM (dense per-step rewards), gold accuracy before and
   after on held-out prompts.

Everything lands in ``--out`` (``results.json``); the table is printed. Figures: docs/process-reward.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from pathlib import Path

import torch


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/prm_bon")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sft-target", type=float, default=0.3, help="greedy dev accuracy at which SFT stops")
    ap.add_argument("--sft-max-steps", type=int, default=3000)
    ap.add_argument("--label-prompts", type=int, default=2000)
    ap.add_argument("--k", type=int, default=8, help="samples per labelled prompt")
    ap.add_argument("--rm-epochs", type=int, default=3)
    ap.add_argument("--verifier-sft-steps", type=int, default=1500,
                    help="SFT steps beyond the policy's for the reward models' backbone (a verifier stronger "
                         "than the generator; 0 = the policy itself)")
    ap.add_argument("--n-eval", type=int, default=500)
    ap.add_argument("--n", type=int, default=8, help="Best-of-N samples per held-out prompt")
    ap.add_argument("--ppo-steps", type=int, default=20)
    ap.add_argument("--ppo-batch", type=int, default=128)
    ap.add_argument("--kl-coef", type=float, default=0.1)
    return ap.parse_args()


MAX_NEW_TOKENS = 12  # "64 201 081" is 10 characters, then [EOS]


def sft(out: Path, args, tok, train, dev) -> tuple[dict, object]:
    from tether.demo.sft import gold_accuracy, sft_train
    from tether.demo.task import build_policy

    policy = build_policy(tok, args.seed)
    curve = []

    def check(step: int, _loss: float) -> bool:
        if step % 50:
            return False
        curve.append((step, gold_accuracy(policy, tok, dev, max_new_tokens=MAX_NEW_TOKENS)["accuracy"]))
        return curve[-1][1] >= args.sft_target

    stats = sft_train(policy, tok, train, args.sft_max_steps, seed=args.seed, callback=check)
    policy.save_pretrained(out / "sft")
    tok.save_pretrained(out / "sft")
    return {"steps": stats["steps"], "dev_curve": curve, "seconds": stats["seconds"]}, policy


def sample(policy, tok, problems, k: int, seed: int) -> list[dict]:
    """``k`` samples per problem at temperature 1: prompt, response, whether it ended with EOS, gold."""
    from tether.demo.sft import generate_answers

    prompts = [p["prompt"] for p in problems for _ in range(k)]
    gens = generate_answers(policy, tok, prompts, greedy=False, max_new_tokens=MAX_NEW_TOKENS, seed=seed,
                            batch_size=1024)
    answers = [p["answer"] for p in problems for _ in range(k)]
    return [{"prompt": p, "response": g["response"], "eos": g["ended_with_eos"],
             "gold": int(g["ended_with_eos"] and g["response"] == a)} for p, g, a in zip(prompts, gens, answers)]


def verifier_dir(out: Path, args) -> Path:
    """The reward models' backbone: the longer SFT, or the policy's own with --verifier-sft-steps 0."""
    return out / ("verifier_sft" if args.verifier_sft_steps else "sft")


def train_rm(out: Path, name: str, examples, separator: str, args):
    """``train-rm --process`` on ``examples`` written to ``out/NAME_steps.jsonl`` (the file path users take)."""
    from tether.rm.config import RewardTrainingConfig
    from tether.rm.steps import write_step_examples
    from tether.rm.train_process import train_process_reward_model

    write_step_examples(examples, out / f"{name}_steps.jsonl")
    cfg = RewardTrainingConfig(model=str(verifier_dir(out, args)), output_dir=str(out / name), seed=args.seed, process=True)
    cfg.data.files = [str(out / f"{name}_steps.jsonl")]
    cfg.data.step_separator, cfg.data.eval_fraction, cfg.data.max_length = separator, 0.1, 64
    cfg.optim.lr, cfg.optim.epochs, cfg.optim.batch_size = 3e-4, args.rm_epochs, 32
    cfg.validate()
    return train_process_reward_model(cfg)


def train_bt_orm(out: Path, labelled: list[dict], args):
    """The demo's outcome RM recipe for comparison: Bradley–Terry on (right ≻ wrong) pairs of samples to one
    prompt (up to 4 per prompt), read at an appended [EOS]; the same samples and backbone."""
    from tether.inputs.pairs import PreferencePair
    from tether.demo.task import build_tokenizer
    from tether.rm.config import RewardTrainingConfig
    from tether.rm.train import train_reward_model

    eos_dir = out / "bt_backbone"  # the backbone with a tokenizer that appends [EOS] (tether.demo.pipeline's)
    if not eos_dir.is_dir():
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(verifier_dir(out, args)).save_pretrained(eos_dir)
        build_tokenizer(eos_dir, eos_after_text=True)
    rng, by_prompt, pairs = random.Random(args.seed), {}, []
    for s in labelled:
        by_prompt.setdefault(s["prompt"], ([], []))[1 - s["gold"]].append(s["response"])
    for prompt, (right, wrong) in by_prompt.items():
        options = sorted({(r, w) for r in right for w in wrong})
        pairs += [PreferencePair(prompt, r, w, "samples") for r, w in rng.sample(options, min(4, len(options)))]
    cfg = RewardTrainingConfig(model=str(eos_dir), output_dir=str(out / "bt_orm"), seed=args.seed)
    cfg.data.files, cfg.data.format, cfg.data.max_length = ["(sampled pairs)"], "plain", 32
    cfg.optim.lr, cfg.optim.epochs, cfg.optim.batch_size = 3e-4, args.rm_epochs, 32
    cfg.validate()
    return train_reward_model(cfg, pairs)


def best_of_n(samples: list[dict], n: int, scores: torch.Tensor) -> list[int]:
    """Gold of the highest-scoring sample of each group of ``n`` (first one on ties)."""
    return [samples[i * n + int(torch.argmax(scores[i * n:(i + 1) * n]))]["gold"] for i in range(len(samples) // n)]


def weighted_vote(samples: list[dict], n: int, weights: torch.Tensor | None) -> list[int]:
    """Gold of the response whose copies among each group of ``n`` have the largest summed weight (weights
    None: count them, the majority vote / self-consistency); a verifier then re-weights the majority."""
    out = []
    for i in range(len(samples) // n):
        totals: dict[str, float] = {}
        for j in range(i * n, (i + 1) * n):
            key = samples[j]["response"]
            totals[key] = totals.get(key, 0.0) + (1.0 if weights is None else float(weights[j]))
        best = max(totals, key=totals.get)
        out.append(next(samples[j]["gold"] for j in range(i * n, (i + 1) * n) if samples[j]["response"] == best))
    return out


def ppo(out: Path, args, train, held) -> dict:
    from tether.demo.pipeline import curves
    from tether.ppo.config import RunConfig
    from tether.ppo.train import train as run_ppo

    for name, rows in (("prompts_train.jsonl", train), ("prompts_heldout.jsonl", held)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = RunConfig()
    cfg.output_dir, cfg.seed, cfg.steps, cfg.batch_size = str(out / "ppo_prm"), args.seed, args.ppo_steps, args.ppo_batch
    cfg.model.policy = str(out / "sft")
    cfg.data.prompts, cfg.data.eval_prompts = str(out / "prompts_train.jsonl"), str(out / "prompts_heldout.jsonl")
    cfg.reward.sources, cfg.reward.gold, cfg.reward.process = [str(out / "prm")], "tether.demo.steps:gold_reward", "per_step"
    cfg.generation.max_new_tokens, cfg.generation.temperature = MAX_NEW_TOKENS, 1.0
    cfg.kl.coef, cfg.kl.controller = args.kl_coef, "fixed"
    cfg.ppo.epochs, cfg.ppo.mini_batches = 4, 4
    cfg.optim.lr, cfg.optim.critic_lr = 5e-5, 5e-4
    cfg.critic.kind, cfg.critic.model, cfg.critic.warmup_steps = "separate", str(out / "prm"), 3
    cfg.eval.every, cfg.eval.n, cfg.eval.samples, cfg.eval.at_start = max(1, args.ppo_steps // 4), len(held), 8, True
    cfg.validate()
    run_dir = run_ppo(cfg)
    c = curves(run_dir)
    return {"eval_step": c["eval_step"], "gold_accuracy": c["gold_accuracy"], "eval_reward": c["eval_rm_reward"],
            "train_reward": c["rm_reward"], "kl": c["kl"]}


def main() -> None:
    from tether.core.stats import mcnemar_exact, wilson_interval
    from tether.demo.sft import gold_accuracy, sft_train
    from tether.demo.steps import STEP_SEPARATOR, split_chain_problems, step_labels
    from tether.demo.task import EOS, build_tokenizer
    from tether.rm.steps import StepExample, label_with_rule

    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0, seconds = time.perf_counter(), {}
    tok = build_tokenizer()
    train, held = split_chain_problems(args.seed, 20000, args.n_eval)
    dev, train = train[:300], train[300:]

    if (out / "sft" / "config.json").is_file() and (out / "sft_info.json").is_file():  # a re-run reuses its SFT
        from transformers import AutoModelForCausalLM

        sft_info = json.loads((out / "sft_info.json").read_text())
        policy = AutoModelForCausalLM.from_pretrained(out / "sft").eval()
    else:
        sft_info, policy = sft(out, args, tok, train, dev)
        (out / "sft_info.json").write_text(json.dumps(sft_info))
    seconds["sft"] = time.perf_counter() - t0
    greedy = gold_accuracy(policy, tok, held, max_new_tokens=MAX_NEW_TOKENS)
    print(f"SFT: {sft_info['steps']} steps, held-out greedy {greedy['accuracy']:.3f}")

    if args.verifier_sft_steps and not (out / "verifier_sft" / "config.json").is_file():
        verifier = copy.deepcopy(policy)
        sft_train(verifier, tok, train, args.verifier_sft_steps, seed=args.seed + 10)
        verifier.save_pretrained(out / "verifier_sft")
        tok.save_pretrained(out / "verifier_sft")
        verifier_greedy = gold_accuracy(verifier, tok, held, max_new_tokens=MAX_NEW_TOKENS)["accuracy"]
        (out / "verifier_info.json").write_text(json.dumps({"extra_steps": args.verifier_sft_steps,
                                                            "greedy_heldout": verifier_greedy}))
    verifier_info = json.loads((out / "verifier_info.json").read_text()) if args.verifier_sft_steps else None
    if verifier_info:
        print(f"verifier backbone: SFT + {verifier_info['extra_steps']} steps, held-out greedy "
              f"{verifier_info['greedy_heldout']:.3f}")
    seconds["verifier_sft"] = time.perf_counter() - t0 - seconds["sft"]

    label_problems = random.Random(args.seed).sample(train, args.label_prompts)
    labelled = sample(policy, tok, label_problems, args.k, seed=args.seed + 1)
    # PRM data: every step by the step rule; ORM data: the whole response, labelled by the gold rule
    prm_examples = label_with_rule([{"prompt": s["prompt"], "response": s["response"]} for s in labelled],
                                   step_labels, STEP_SEPARATOR)
    orm_examples = [StepExample(s["prompt"], [s["response"]], [s["gold"]]) for s in labelled]
    t = time.perf_counter()
    prm = train_rm(out, "prm", prm_examples, STEP_SEPARATOR, args)
    orm = train_rm(out, "orm", orm_examples, EOS, args)
    bt_orm = train_bt_orm(out, labelled, args)
    seconds["reward_models"] = time.perf_counter() - t

    t = time.perf_counter()
    samples = sample(policy, tok, held, args.n, seed=args.seed + 2)
    prompts, responses = [s["prompt"] for s in samples], [s["response"] for s in samples]
    prm_scores, orm_scores = prm.score(prompts, responses), orm.score(prompts, responses)
    bt_scores = bt_orm.score(prompts, responses)
    picked = {"prm": best_of_n(samples, args.n, prm_scores), "orm": best_of_n(samples, args.n, orm_scores)}
    groups = [samples[i * args.n:(i + 1) * args.n] for i in range(len(held))]
    rows = {"greedy": greedy["correct"], "random pick": None, "ORM pick": picked["orm"], "PRM pick": picked["prm"],
            "BT ORM pick (pairs)": best_of_n(samples, args.n, bt_scores),
            "majority vote": weighted_vote(samples, args.n, None),
            "ORM-weighted vote": weighted_vote(samples, args.n, orm_scores),
            "PRM-weighted vote": weighted_vote(samples, args.n, prm_scores),
            f"oracle (pass@{args.n})": [int(any(s["gold"] for s in g)) for g in groups]}
    mean_sample = sum(s["gold"] for s in samples) / len(samples)
    table = {}
    for name, correct in rows.items():
        if correct is None:
            table[name] = {"accuracy": mean_sample, "n": len(samples)}
            continue
        low, high = wilson_interval(sum(correct), len(correct))
        table[name] = {"accuracy": sum(correct) / len(correct), "low": low, "high": high, "n": len(correct)}
    only_prm = sum(p and not o for p, o in zip(picked["prm"], picked["orm"]))
    only_orm = sum(o and not p for p, o in zip(picked["prm"], picked["orm"]))
    seconds["best_of_n"] = time.perf_counter() - t
    print(f"Best-of-{args.n} on {len(held)} held-out prompts:")
    for name, r in table.items():
        interval = f" [{r['low']:.3f}, {r['high']:.3f}]" if "low" in r else " (mean over samples)"
        print(f"  {name:18s} {r['accuracy']:.3f}{interval}")
    print(f"  PRM vs ORM, paired: PRM only right on {only_prm}, ORM only on {only_orm}, McNemar p = "
          f"{mcnemar_exact(only_prm, only_orm):.3g}")

    t = time.perf_counter()
    ppo_info = ppo(out, args, train, held) if args.ppo_steps else None
    seconds["ppo"] = time.perf_counter() - t
    if ppo_info:
        print(f"PPO with the PRM (per-step rewards), {args.ppo_steps} steps: held-out gold "
              f"{' -> '.join(f'{a:.3f}' for a in ppo_info['gold_accuracy'])}; reward "
              f"{' -> '.join(f'{r:+.3f}' for r in ppo_info['eval_reward'])}")
    results = {"seed": args.seed, "args": vars(args), "sft": {**sft_info, "greedy_heldout": greedy["accuracy"]},
               "verifier_backbone": verifier_info,
               "prm_eval": prm.metadata["evaluation"], "orm_eval": orm.metadata["evaluation"],
               "bt_orm_eval": {k: v for k, v in bt_orm.metadata["evaluation"].items() if not isinstance(v, list)},
               "best_of_n": table, "prm_vs_orm": {"only_prm": only_prm, "only_orm": only_orm,
                                                 "mcnemar_p": mcnemar_exact(only_prm, only_orm)},
               "ppo": ppo_info, "seconds": {**seconds, "total": time.perf_counter() - t0}}
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
