#!/usr/bin/env python
"""Does each standard fast path pay on a PPO step's pieces? (#16, item 3). On the bench's GPT-2 policy
(bench/ppo_step.py, --size small|medium), at the PPO step's shapes (64 rollouts, prompt + 48 response tokens,
minibatch 16), each variant against its baseline in the same process, interleaved, median of --repeats:

- AdamW: ``foreach`` (torch's default, what tether uses) vs ``fused=True``: seconds per optimizer step, and
  that step's share of one minibatch update (forward + backward + step);
- scoring forward (old log-probs over the 64 rollouts): ``torch.no_grad`` (tether) vs ``torch.inference_mode``;
- the minibatch forward + backward: eager vs ``torch.compile`` (dynamic shapes, as trimmed minibatches vary in
  width), with the compile time it costs up front.

Usage: python bench/fast_paths.py [--size medium] [--repeats 5] [--json FILE]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from ppo_step import SIZES, build_models  # noqa: E402

PROMPT, RESPONSE, ROWS, MINIBATCH = 28, 48, 64, 16


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def batch(vocab: int, rows: int):
    from tether.rollout.records import Rollout

    g = torch.Generator().manual_seed(0)
    query = torch.randint(0, vocab - 4, (rows, PROMPT), generator=g)
    response = torch.randint(0, vocab - 4, (rows, RESPONSE), generator=g)
    ones = torch.ones_like
    return Rollout(query=query, query_mask=ones(query), response=response, response_mask=ones(response),
                   ended_with_eos=torch.zeros(rows, dtype=torch.bool))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="medium")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile measurement")
    p.add_argument("--json")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from tether.hf import load_causal_lm
    from tether.ppo.forward import forward_response

    with tempfile.TemporaryDirectory() as tmp:
        policy_dir, _, n_params = build_models(Path(tmp), a.size)
        model = load_causal_lm(policy_dir).train()
    vocab = model.config.vocab_size
    rollouts, minibatch = batch(vocab, ROWS), batch(vocab, MINIBATCH)
    figures = {}

    def update_step(optimizer, m=model):
        logprobs, _, _ = forward_response(m, minibatch, 0.7)
        (-logprobs.mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # AdamW: foreach vs fused, each with its own state, alternating.
    optimizers = {"foreach": torch.optim.AdamW(model.parameters(), lr=1e-9, foreach=True),
                  "fused": torch.optim.AdamW(model.parameters(), lr=1e-9, fused=True)}
    for opt in optimizers.values():
        update_step(opt)  # warm-up: state allocated
    step_s, update_s = {k: [] for k in optimizers}, {k: [] for k in optimizers}
    for _ in range(a.repeats):
        for name, opt in optimizers.items():
            logprobs, _, _ = forward_response(model, minibatch, 0.7)
            (-logprobs.mean()).backward()
            step_s[name] += timed(opt.step, 1)
            opt.zero_grad(set_to_none=True)
            update_s[name] += timed(lambda o=opt: update_step(o), 1)
    figures["adamw"] = {k: {"step_s": statistics.median(step_s[k]), "update_s": statistics.median(update_s[k])}
                        for k in optimizers}

    # Scoring forward: no_grad vs inference_mode.
    model.eval()
    scoring = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    score_s = {k: [] for k in scoring}
    for _ in range(a.repeats):
        for name, ctx in scoring.items():
            def score(c=ctx):
                with c():
                    forward_response(model, rollouts, 0.7)
            score_s[name] += timed(score, 1)
    figures["scoring"] = {k: statistics.median(v) for k, v in score_s.items()}
    model.train()

    # torch.compile of the training forward + backward (no optimizer step: same weights every call).
    if not a.no_compile:
        compiled = torch.compile(model, dynamic=True)

        def fwd_bwd(m):
            logprobs, _, _ = forward_response(m, minibatch, 0.7)
            (-logprobs.mean()).backward()
            model.zero_grad(set_to_none=True)

        t = time.perf_counter()
        fwd_bwd(compiled)
        compile_s = time.perf_counter() - t
        eager_s, compiled_s = [], []
        for _ in range(a.repeats):
            eager_s += timed(lambda: fwd_bwd(model), 1)
            compiled_s += timed(lambda: fwd_bwd(compiled), 1)
        figures["compile"] = {"first_call_s": compile_s, "eager_s": statistics.median(eager_s),
                              "compiled_s": statistics.median(compiled_s)}

    print(f"fast paths: {a.size} GPT-2 ({n_params / 1e6:.2f}M params), {torch.get_num_threads()} threads, "
          f"median of {a.repeats}, interleaved")
    ad = figures["adamw"]
    print(f"  AdamW step           foreach {ad['foreach']['step_s'] * 1e3:7.1f} ms   fused {ad['fused']['step_s'] * 1e3:7.1f} ms"
          f"   (one minibatch update: {ad['foreach']['update_s'] * 1e3:.0f} vs {ad['fused']['update_s'] * 1e3:.0f} ms)")
    sc = figures["scoring"]
    print(f"  scoring forward x{ROWS}  no_grad {sc['no_grad'] * 1e3:7.1f} ms   inference_mode {sc['inference_mode'] * 1e3:7.1f} ms")
    if "compile" in figures:
        c = figures["compile"]
        print(f"  minibatch fwd+bwd    eager {c['eager_s'] * 1e3:7.1f} ms   compiled {c['compiled_s'] * 1e3:7.1f} ms"
              f"   (first compiled call {c['first_call_s']:.1f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps({"size": a.size, "params": n_params, **figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
