"""Issue 51's findings outside the doctor, each at the shape where it was found: the KL percentile above 2^24 tokens
(10), `tether sample` combining two rules as PPO does when one returns None (9), and a real resume that keeps the
rollback targets and the non-finite skip streak (6)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny import make_policy_dir, make_prompts_file, tiny_config

from tether.core.stats import quantile

# ---------------------------------------------------------------- 10: objective/kl_p99 at any size


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 1001])
@pytest.mark.parametrize("q", [0.0, 0.01, 0.5, 0.99, 1.0])
def test_quantile_is_torch_quantiles_definition(n, q):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64) ** 3
    assert quantile(x, q).item() == pytest.approx(torch.quantile(x, q).item(), rel=1e-12, abs=1e-12)
    # float32: torch.quantile places the rank in float32 (q (n - 1) rounded), this one in float64
    assert quantile(x.float(), q).item() == pytest.approx(torch.quantile(x.float(), q).item(), rel=1e-4)
    # by hand: the two order statistics around h = q (n - 1), linearly interpolated
    v, h = sorted(x.tolist()), q * (n - 1)
    lo = math.floor(h)
    expected = v[lo] + (h - lo) * (v[min(lo + 1, n - 1)] - v[lo])
    assert quantile(x, q).item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_quantile_with_ties_and_a_2d_input():
    x = torch.tensor([[3.0, 1.0, 1.0], [1.0, 9.0, 3.0]])
    assert quantile(x, 0.5).item() == torch.quantile(x.flatten(), 0.5).item() == 2.0
    with pytest.raises(ValueError):
        quantile(torch.zeros(0), 0.5)


def test_kl_p99_above_2_to_the_24_tokens():
    """One process's step with more than 2^24 valid tokens (1,024 rows x 16k tokens): torch.quantile raised
    "input tensor is too large"; the order-statistic quantile gives the 99th percentile, checked by hand on a
    KL whose sorted values are known (a permutation of 0..n-1: the p-quantile is p (n - 1))."""
    from tether.ppo.metrics import objective_metrics
    from tether.ppo.processes import Processes

    n = 2**24 + 1001
    kl = torch.randperm(n, generator=torch.Generator().manual_seed(0)).float().reshape(1, n)
    mask, valid = torch.ones(1, n), torch.tensor([True])
    p = Processes(accelerator=None, device=torch.device("cpu"), world_size=1, rank=0)
    with pytest.raises(RuntimeError, match="too large"):
        torch.quantile(kl, 0.99)  # the old computation
    got = objective_metrics(p, torch.ones(1), torch.ones(1), torch.zeros(1, n), kl, mask, valid, 0.0, 0.1)
    assert got["objective/kl_p99"] == pytest.approx(0.99 * (n - 1), rel=1e-6)
    assert got["objective/kl_max"] == n - 1


# ---------------------------------------------------------------- 9: tether sample combines rules as PPO does


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("trust")
    return make_policy_dir(root), make_prompts_file(root)


def test_sample_with_two_rules_keeps_a_sample_one_of_them_does_not_judge(files, tmp_path):
    """Rule ``odd`` judges odd-length replies (1.0) and returns None for the others; ``two_mod_four`` judges those of
    length 2 mod 4 (0.5). PPO's judged_sum scores a reply by the rules that judged it: odd 1.0, 2 mod 4 0.5, 0 mod 4
    NaN (no rule judged it). The old sample summed the two (None is NaN): every sample NaN, nothing kept."""
    from tether.sft.sample import rejection_sample

    policy, prompts = files
    seen: list[str] = []

    def odd(prompts, responses, **_):
        seen.extend(responses)
        return [1.0 if len(r) % 2 else None for r in responses]

    def two_mod_four(prompts, responses, **_):
        return [0.5 if len(r) % 4 == 2 else None for r in responses]

    out = tmp_path / "rft.jsonl"
    result = rejection_sample({"model": {"policy": str(policy)}, "data": {"prompts": str(prompts), "max_prompts": 6},
                               "output": str(out), "samples_per_prompt": 4, "batch_size": 6, "progress": False,
                               "generation": {"max_new_tokens": 6}, "accept": {"require_eos": False}},
                               reward={"odd": odd, "two_mod_four": two_mod_four})

    def score(r):
        return 1.0 if len(r) % 2 else 0.5 if len(r) % 4 == 2 else math.nan

    accepted = [r for r in seen if score(r) >= 0.5]
    assert accepted and len(accepted) < len(seen)  # the tiny policy's replies have lengths of every kind
    assert result.counts["accepted"] == len(accepted)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(r["score"] == score(r["completion"]) for r in rows)


# ---------------------------------------------------------------- 6: a real resume keeps the health bookkeeping


def _rollback_config(tmp_path, files, name, steps=6):
    policy, prompts = files
    return tiny_config(tmp_path / name, policy, prompts, steps=steps, batch_size=4, save_every=1, keep_checkpoints=6,
                       health__rollback=True, reward__sources=["alarm_rules:rising"],
                       reward__gold="alarm_rules:right_twice", eval__every=1, eval__n=16, eval__samples=2,
                       data__eval_fraction=0.5)


class StopAt:
    """A callback that stops the run after ``step`` (the trainer checkpoints there: --resume continues)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, record):
        from tether.callbacks import StopTraining

        if record.step == self.step:
            raise StopTraining(f"stopped at step {self.step}")


def _policy_weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_rollback_after_a_resume_finds_the_checkpoint_the_uninterrupted_run_finds(files, tmp_path, capsys):
    """The gold rule marks the 16 held-out problems right at the first two evaluations and wrong after, while the
    reward rises: the gold band alarms and --rollback-on-alarm restores the newest checkpoint saved before the fall
    (step_000002 with evaluations from step 1; step_000001 when one runs at step 0 too). Stopped right after that
    checkpoint and resumed, the run must restore the same one (it said "nothing to roll back to": the list of healthy
    checkpoints was not in the checkpoint)."""
    import re

    import alarm_rules

    from tether.ppo.train import PPOTrainer, train

    alarm_rules.reset()
    straight = train(_rollback_config(tmp_path, files, "straight"))
    target = re.search(r"rolled back to (step_(\d+))", capsys.readouterr().err)
    assert target is not None
    name, k = target.group(1), int(target.group(2))
    assert all(torch.equal(a, b) for a, b in zip(_policy_weights(straight / "policy").values(), _policy_weights(
        straight / "checkpoints" / name / "policy").values()))

    alarm_rules.reset()
    cfg = _rollback_config(tmp_path, files, "resumed")
    assert PPOTrainer(cfg, callbacks=[StopAt(k)]).train().stopped == f"stopped at step {k}"
    capsys.readouterr()
    resumed = train(cfg, resume=True)
    out = capsys.readouterr().err
    assert f"rolled back to {name}" in out and "nothing to roll back to" not in out
    weights = _policy_weights(resumed / "policy")
    assert all(torch.equal(weights[k], v) for k, v in _policy_weights(resumed / "checkpoints" / name / "policy").items())
    last = sorted((resumed / "checkpoints").iterdir())[-1]  # where the alarm stopped it: other weights
    assert last.name != name and any(not torch.equal(weights[k], v) for k, v in _policy_weights(last / "policy").items())


def test_the_skip_streak_continues_across_a_resume(files, tmp_path, monkeypatch):
    """Every update skipped (a NaN loss) from step 2 on, --max-skipped-steps 3: the uninterrupted run stops at step 4.
    Stopped after step 3 (streak 2) and resumed, the run must stop at step 4 as well, not restart the streak at 0 and
    go on to step 6."""
    import tether.ppo.train as train_module
    import tether.ppo.update as update_module
    from tether.errors import TetherError

    policy, prompts = files
    real_forward, real_step = update_module.forward_response, train_module.ppo_step
    state = {"broken": False}

    def nan_when_broken(model, batch, temperature, **kwargs):
        logprobs, entropy, hidden = real_forward(model, batch, temperature, **kwargs)
        if torch.is_grad_enabled() and state["broken"]:
            logprobs = logprobs * float("nan")
        return logprobs, entropy, hidden

    def step_then_break(run, cfg, step):
        state["broken"] = step >= 2
        return real_step(run, cfg, step)

    monkeypatch.setattr(update_module, "forward_response", nan_when_broken)
    monkeypatch.setattr(train_module, "ppo_step", step_then_break)
    cfg = tiny_config(tmp_path, policy, prompts, steps=8, save_every=1, health__max_skipped_steps=3)
    assert train_module.PPOTrainer(cfg, callbacks=[StopAt(3)]).train().stopped == "stopped at step 3"
    with pytest.raises(TetherError, match=r"step 4: 3 consecutive steps skipped every optimizer update"):
        train_module.train(cfg, resume=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["step"] > 0] == [1, 2, 3, 4]  # (step 0: an evaluation at the start)
