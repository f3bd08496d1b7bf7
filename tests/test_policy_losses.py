"""The policy losses of docs/losses.md — PPO with clip-higher, GSPO, GSPO-token, CISPO — against values worked by
hand or by a slow loop over tokens, their gradients against autograd of a hand formula, the config's choices and
refusals, a tiny end-to-end run with each, and bench/losses_vs_peers.py's comparison with TRL's and veRL's code."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from tiny import make_policy_dir, make_prompts_file

from tether.core.losses import (
    cispo_policy_loss,
    gspo_policy_loss,
    ppo_policy_loss,
    sequence_log_ratio,
)

REPO = Path(__file__).resolve().parents[1]

# The 2×3 example: row 0 has three valid tokens, row 1 two (its third is padding and must count nowhere).
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
RATIOS = [[1.1, 0.9, 1.3], [0.7, 1.05, 50.0]]
ADV = [[1.0, -0.5, 2.0], [-1.0, 0.5, 9.0]]


def one_token(loss_fn, ratio: float, advantage: float, **kwargs) -> tuple[float, float, dict]:
    """(loss, d loss / d log π, stats) at one token with log π_old = 0."""
    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, stats = loss_fn(logprobs, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1), **kwargs)
    loss.backward()
    return loss.item(), logprobs.grad.item(), stats


# ---- PPO with clip-higher -------------------------------------------------------------------------------------

def test_clip_higher_leaves_a_ratio_of_1_25_unclipped_at_0_28_and_clips_it_at_0_2():
    loss, grad, stats = one_token(ppo_policy_loss, 1.25, 1.0, clip_range=0.2, clip_range_high=0.28)
    assert loss == pytest.approx(-1.25) and grad == pytest.approx(-1.25)  # −ρA, gradient −ρA
    assert stats["clip_fraction"].item() == 0.0 and stats["clip_fraction_high"].item() == 0.0
    loss, grad, stats = one_token(ppo_policy_loss, 1.25, 1.0, clip_range=0.2)  # symmetric: 1 + 0.2 binds
    assert loss == pytest.approx(-1.2) and grad == 0.0
    assert stats["clip_fraction_high"].item() == 1.0 and stats["clip_fraction_low"].item() == 0.0
    # the low side still clips at 1 − ε_low whatever ε_high: ρ = 0.75, A < 0
    loss, grad, stats = one_token(ppo_policy_loss, 0.75, -1.0, clip_range=0.2, clip_range_high=0.28)
    assert loss == pytest.approx(0.8) and grad == 0.0
    assert stats["clip_fraction_low"].item() == 1.0 and stats["clip_fraction"].item() == 1.0


def test_ppo_clip_higher_on_the_2x3_example_by_hand():
    # ε_low 0.2, ε_high 0.28: clip to [0.8, 1.28]; per token −min(ρA, clip(ρ)A)
    #   row 0: ρ 1.1 A 1 -> −1.1 ; ρ 0.9 A −0.5 -> −min(−0.45, −0.45) = 0.45 ; ρ 1.3 A 2 -> −min(2.6, 2.56) = −2.56
    #   row 1: ρ 0.7 A −1 -> −min(−0.7, −0.8) = 0.8 ; ρ 1.05 A 0.5 -> −0.525 ; padding
    expected = (-1.1 + 0.45 - 2.56 + 0.8 - 0.525) / 5
    loss, stats = ppo_policy_loss(torch.tensor(RATIOS).log(), torch.zeros(2, 3), torch.tensor(ADV), MASK, 0.2,
                                  clip_range_high=0.28)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # clipped ratios: 1.3 > 1.28 (high), 0.7 < 0.8 (low); 50 is padding
    assert stats["clip_fraction_high"].item() == pytest.approx(1 / 5)
    assert stats["clip_fraction_low"].item() == pytest.approx(1 / 5)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 5)


# ---- GSPO and GSPO-token --------------------------------------------------------------------------------------

def test_gspo_on_the_2x3_example_by_hand():
    # s_0 = (1.1·0.9·1.3)^(1/3), s_1 = (0.7·1.05)^(1/2); A_i the row mean of Â; ε 0.2 / 0.28
    s0, s1 = (1.1 * 0.9 * 1.3) ** (1 / 3), (0.7 * 1.05) ** 0.5  # 1.0833, 0.8573
    a0, a1 = (1.0 - 0.5 + 2.0) / 3, (-1.0 + 0.5) / 2
    clip = lambda s: min(max(s, 0.8), 1.28)
    l0, l1 = -min(s0 * a0, clip(s0) * a0), -min(s1 * a1, clip(s1) * a1)
    expected = (3 * l0 + 2 * l1) / 5  # a token mean: row i weighs |y_i|
    logprobs = torch.tensor(RATIOS).log()
    loss, stats = gspo_policy_loss(logprobs, torch.zeros(2, 3), torch.tensor(ADV), MASK, 0.2, clip_range_high=0.28)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(sequence_log_ratio(logprobs, torch.zeros(2, 3), MASK),
                               torch.tensor([math.log(s0), math.log(s1)]))
    assert stats["clip_fraction"].item() == 0.0  # both sequence ratios inside [0.8, 1.28]
    # with the paper's small range both rows clip: s_0 above 1 + 4e-4 (3 tokens), s_1 below 1 − 3e-4 (2 tokens)
    loss, stats = gspo_policy_loss(logprobs, torch.zeros(2, 3), torch.tensor(ADV), MASK, 3e-4, clip_range_high=4e-4)
    l0, l1 = -min(s0 * a0, (1 + 4e-4) * a0), -min(s1 * a1, (1 - 3e-4) * a1)
    assert loss.item() == pytest.approx((3 * l0 + 2 * l1) / 5, rel=1e-6)
    assert stats["clip_fraction_high"].item() == pytest.approx(3 / 5)
    assert stats["clip_fraction_low"].item() == pytest.approx(2 / 5)


def gspo_by_hand(logprobs, logprobs_old, adv, mask, eps, token_level):
    """GSPO / GSPO-token written out token by token from the paper's eqs. 5–7 and 13–14, as autograd sees them."""
    total, n = 0.0, mask.sum()
    for i in range(logprobs.shape[0]):
        valid = [t for t in range(logprobs.shape[1]) if mask[i, t] > 0]
        log_s = sum(logprobs[i, t] - logprobs_old[i, t] for t in valid) / len(valid)
        a_i = sum(adv[i, t] for t in valid) / len(valid)
        for t in valid:
            if token_level:
                s = torch.exp(log_s.detach() + logprobs[i, t] - logprobs[i, t].detach())
                a = adv[i, t]
            else:
                s, a = torch.exp(log_s), a_i
            total = total - torch.min(s * a, torch.clamp(s, 1 - eps, 1 + eps) * a)
    return total / n


def test_gspo_and_gspo_token_same_loss_different_per_token_gradient():
    """With an advantage that varies along a row (GAE), the two forms give the same loss value (nothing clipped)
    but token t's gradient is −s_i·A_i/N for GSPO and −s_i·Â_i,t/N for GSPO-token (the paper, after eq. 14)."""
    torch.manual_seed(0)
    old = torch.randn(2, 3)
    base = old + 0.05 * torch.randn(2, 3)
    adv = torch.tensor(ADV)
    grads, losses = {}, {}
    for token_level in (False, True):
        lp = base.clone().requires_grad_(True)
        loss, _ = gspo_policy_loss(lp, old, adv, MASK, 0.5, token_level=token_level)
        loss.backward()
        grads[token_level], losses[token_level] = lp.grad, loss.item()
        lp_hand = base.clone().requires_grad_(True)
        hand = gspo_by_hand(lp_hand, old, adv, MASK, 0.5, token_level)
        hand.backward()
        assert loss.item() == pytest.approx(hand.item(), rel=1e-6)
        torch.testing.assert_close(lp.grad, lp_hand.grad, rtol=1e-5, atol=1e-7)
    assert losses[False] == pytest.approx(losses[True], rel=1e-6)
    s = torch.exp(sequence_log_ratio(base, old, MASK))[:, None]  # (2, 1)
    a_row = ((adv * MASK).sum(1) / MASK.sum(1))[:, None]
    torch.testing.assert_close(grads[False], -s * a_row * MASK / 5)
    torch.testing.assert_close(grads[True], -s * adv * MASK / 5)
    assert (grads[False] - grads[True]).abs().max() > 0.1  # they do differ token by token


def test_gspo_token_equals_gspo_in_value_and_gradient_with_one_advantage_per_row():
    torch.manual_seed(1)
    old = torch.randn(2, 3)
    base = old + 0.01 * torch.randn(2, 3)
    adv = torch.tensor([[0.7], [-1.3]]).expand(2, 3)
    out = []
    for token_level in (False, True):
        lp = base.clone().requires_grad_(True)
        loss, _ = gspo_policy_loss(lp, old, adv, MASK, 3e-4, clip_range_high=4e-4, token_level=token_level)
        loss.backward()
        out.append((loss.detach(), lp.grad))
    torch.testing.assert_close(out[0][0], out[1][0])
    torch.testing.assert_close(out[0][1], out[1][1])


def test_gspo_clips_a_whole_sequence():
    """s_i above 1 + ε_high with A_i > 0: the clipped term is the min, every token of the row has gradient 0; the
    other row, inside the range, keeps −s·A/N on each token."""
    lp = torch.tensor([[0.1, 0.1, 0.1], [0.0, 0.0, 0.0]], requires_grad=True)  # s_0 = e^0.1, s_1 = 1
    adv = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    loss, stats = gspo_policy_loss(lp, torch.zeros(2, 3), adv, MASK, 0.05)
    loss.backward()
    assert loss.item() == pytest.approx((-3 * 1.05 - 2 * 2.0) / 5, rel=1e-6)
    assert lp.grad[0].abs().max() == 0.0
    torch.testing.assert_close(lp.grad[1], torch.tensor([-2.0 / 5, -2.0 / 5, 0.0]))
    assert stats["clip_fraction_high"].item() == pytest.approx(3 / 5)


# ---- CISPO ----------------------------------------------------------------------------------------------------

def test_cispo_against_a_loop_over_tokens():
    """L = −(1/N) Σ sg[clip(ρ, 1−ε_low, 1+ε_high)]·Â·log π: value from a loop, and the gradient on log π_t is
    −clip(ρ_t)·Â_t/N even where the ratio is clipped (PPO's would be 0 there)."""
    logprobs = torch.tensor(RATIOS).log() + torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]])
    lp = logprobs.clone().requires_grad_(True)
    loss, stats = cispo_policy_loss(lp, old, torch.tensor(ADV), MASK, 0.2, clip_range_high=0.28)
    loss.backward()
    total, grad = 0.0, torch.zeros(2, 3)
    for i in range(2):
        for t in range(3):
            if MASK[i, t] == 0:
                continue
            w = min(max(RATIOS[i][t], 0.8), 1.28)
            total += -w * ADV[i][t] * logprobs[i, t].item()
            grad[i, t] = -w * ADV[i][t] / 5
    assert loss.item() == pytest.approx(total / 5, rel=1e-6)
    torch.testing.assert_close(lp.grad, grad)
    assert lp.grad[0, 2].item() != 0.0 and lp.grad[1, 0].item() != 0.0  # the two clipped tokens still learn
    assert stats["clip_fraction"].item() == pytest.approx(2 / 5)


def test_every_loss_multiplies_the_correction_weights_and_ignores_padding():
    lp, old, adv = torch.tensor(RATIOS).log(), torch.zeros(2, 3), torch.tensor(ADV)
    weights = torch.tensor([[0.5, 2.0, 1.0], [1.0, 0.0, 123.0]])
    for fn in (ppo_policy_loss, cispo_policy_loss, gspo_policy_loss):
        plain = fn(lp, old, adv, MASK, 0.2, clip_range_high=0.28)[0]
        # the weighted loss from per-token terms: a weight of 1 everywhere but one token shows that token's term
        per_token = [fn(lp, old, adv, MASK, 0.2, clip_range_high=0.28,
                        weights=torch.zeros(2, 3).index_put_((torch.tensor(i), torch.tensor(t)), torch.tensor(1.0)))
                     [0].item() for i in range(2) for t in range(3)]
        assert sum(per_token) == pytest.approx(plain.item(), rel=1e-6) and per_token[5] == 0.0  # padding
        weighted = fn(lp, old, adv, MASK, 0.2, clip_range_high=0.28, weights=weights)[0]
        assert weighted.item() == pytest.approx(sum(w * x for w, x in zip(weights.flatten().tolist(), per_token)),
                                                rel=1e-6)


# ---- the config ----------------------------------------------------------------------------------------------

def test_policy_loss_choices_refusals_and_trl_names(tmp_path):
    from tiny import tiny_config

    from tether.config import check_fields
    from tether.errors import ConfigError
    from tether.ppo.config import RunConfig

    files = make_policy_dir(tmp_path), make_prompts_file(tmp_path)
    with pytest.raises(ConfigError, match=r"^--policy-loss gspo: .*gspo_token$"):
        tiny_config(tmp_path, *files, ppo__policy_loss="gspo")  # GAE's advantages are per token
    cfg = tiny_config(tmp_path, *files, ppo__policy_loss="gspo", advantage__estimator="grpo", samples_per_prompt=2,
                      ppo__clip_range_high=0.28)
    assert cfg.warnings()[0].startswith("--clip-range-high 0.28: ignored; --policy-loss gspo")
    cfg = tiny_config(tmp_path, *files, ppo__policy_loss="cispo", ppo__gspo_clip_range=1e-3)
    assert cfg.warnings()[0].startswith("--gspo-clip-range 0.001: ignored")
    assert tiny_config(tmp_path, *files, ppo__policy_loss="gspo_token").warnings() == []
    with pytest.raises(ConfigError, match=r"--policy-loss\): 'sapo' is not one of ppo, gspo, gspo_token, cispo"):
        tiny_config(tmp_path, *files, ppo__policy_loss="sapo")
    with pytest.raises(ConfigError, match=r"--clip-range-high\): must be > 0"):
        tiny_config(tmp_path, *files, ppo__clip_range_high=0.0)
    # TRL's names: epsilon_high is ε_high, importance_sampling_level's 'sequence' is GSPO, 'token' PPO
    cfg = check_fields(RunConfig(epsilon=0.2, epsilon_high=0.28, importance_sampling_level="sequence"))
    assert (cfg.ppo.clip_range, cfg.ppo.clip_range_high, cfg.ppo.policy_loss) == (0.2, 0.28, "gspo")
    assert check_fields(RunConfig(importance_sampling_level="token")).ppo.policy_loss == "ppo"
    with pytest.raises(ConfigError, match=r"loss_type.*`ppo.policy_loss` \(cispo"):
        RunConfig(loss_type="cispo")


def test_the_flags_parse():
    from tether.cli import build_parser

    args = build_parser(only="ppo").parse_args(["ppo", "--policy-loss", "gspo_token", "--clip-range-high", "0.28",
                                                "--gspo-clip-range", "1e-3", "--gspo-clip-range-high", "2e-3"])
    got = vars(args)
    assert (got["ppo.policy_loss"], got["ppo.clip_range_high"]) == ("gspo_token", "0.28")
    assert (got["ppo.gspo_clip_range"], got["ppo.gspo_clip_range_high"]) == ("1e-3", "2e-3")


# ---- end to end ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy_losses")
    return make_policy_dir(root), make_prompts_file(root)


@pytest.mark.parametrize("loss", ["ppo", "gspo", "gspo_token", "cispo"])
def test_a_tiny_run_with_each_policy_loss(files, tmp_path, loss):
    """`tether ppo --policy-loss X` (GRPO, K = 2, two steps): finite metrics every step, clip fractions
    logged, and the saved policy's weights differ from the starting ones."""
    from safetensors.torch import load_file

    from tether.cli import main

    out = tmp_path / "run"
    policy, prompts = files
    argv = ["ppo", "--policy", str(policy), "--prompts", str(prompts), "--reward", "tether.rules:char_share",
            "--output-dir", str(out), "--steps", "2", "--batch-size", "4", "--mini-batches", "2",
            "--samples-per-prompt", "2", "--advantage", "grpo", "--max-new-tokens", "5", "--lr", "1e-2",
            "--progress", "false", "--eval-fraction", "0", "--eval-at-start", "false", "--save-every-minutes", "0",
            "--policy-loss", loss, "--clip-range-high", "0.28"]
    if loss.startswith("gspo"):
        argv = argv[:-2]  # GSPO clips by --gspo-clip-range (the paper's default)
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert {"policy/loss", "policy/clip_fraction", "policy/clip_fraction_low",
                "policy/clip_fraction_high"} <= r.keys()
        assert r["policy/clip_fraction"] == pytest.approx(r["policy/clip_fraction_low"]
                                                          + r["policy/clip_fraction_high"])
    before, after = load_file(policy / "model.safetensors"), load_file(out / "policy" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before), f"{loss}: no weight changed"


# ---- the peers -----------------------------------------------------------------------------------------------

def test_the_peers_formulas_agree_where_the_conventions_do():
    """bench/losses_vs_peers.py: TRL's and veRL's loss code, re-typed, against tether's on ragged random tensors."""
    spec = importlib.util.spec_from_file_location("losses_vs_peers", REPO / "bench" / "losses_vs_peers.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclass looks its module up there
    spec.loader.exec_module(bench)
    rows = bench.compare(seed=0)
    agree = [r for r in rows if r.same_convention]
    assert len(agree) >= 6 and all(r.max_abs_diff <= 1e-6 for r in agree), [r for r in agree if r.max_abs_diff > 1e-6]
    # where the conventions differ, the difference is real (else the row should say they agree)
    assert all(r.max_abs_diff > 1e-4 for r in rows if not r.same_convention)
