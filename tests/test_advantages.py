"""GAE, shaped rewards and whitening against hand-derived values and slow float64 references."""


import math

import pytest
import torch
from launcher import spawn_gloo

from tether import gae, masked_mean, shaped_rewards, whiten


def ragged_mask(lengths, T):
    return torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths], dtype=torch.float64)


def gae_weighted_sum(rewards, values, lengths, gamma, lam, last_values):
    """Slow O(T²) form: Â_t = Σ_l (γλ)^l δ_{t+l}, written from the definition, row by row in Python floats."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        n = lengths[b]
        v = list(values[b][:n]) + [last_values[b]]  # V(s_0..s_{n-1}) then the value after the last token
        deltas = [rewards[b][t] + gamma * v[t + 1] - v[t] for t in range(n)]
        for t in range(n):
            adv[b][t] = sum((gamma * lam) ** l * deltas[t + l] for l in range(n - t))
    return adv


def test_reward_on_last_of_four_steps_zero_values():
    # Issue 2: reward only on the last of 4 steps, zero values -> [(γλ)³, (γλ)², γλ, 1].
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.zeros(1, 4)
    mask = torch.ones(1, 4)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    gl = gamma * lam
    torch.testing.assert_close(adv, torch.tensor([[gl**3, gl**2, gl, 1.0]]))
    torch.testing.assert_close(ret, adv)  # returns = A + V with V = 0


def test_hand_computed_with_values():
    # T=2, γ=1, λ=0.5, V=[0.5, 0.25], r=[0, 1], ended with EOS.
    # δ1 = 1 + 0 - 0.25 = 0.75; δ0 = 0 + 0.25 - 0.5 = -0.25; Â1 = 0.75; Â0 = -0.25 + 0.5*0.75 = 0.125
    adv, ret = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.25]]), torch.ones(1, 2), 1.0, 0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.125, 0.75]]))
    torch.testing.assert_close(ret, torch.tensor([[0.625, 1.0]]))


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (1.0, 0.0), (1.0, 1.0), (0.9, 0.7), (0.5, 1.0)])
def test_matches_weighted_sum_on_ragged_masks(gamma, lam):
    g = torch.Generator().manual_seed(0)
    lengths = [1, 5, 3, 7, 7, 2]
    B, T = len(lengths), 7
    mask = ragged_mask(lengths, T)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    last_values = torch.randn(B, generator=g, dtype=torch.float64)
    # Garbage beyond each row's end must not leak into valid positions.
    rewards_garbage = torch.where(mask.bool(), rewards, torch.full_like(rewards, 1e6))
    values_garbage = torch.where(mask.bool(), values, torch.full_like(values, -1e6))
    adv, ret = gae(rewards_garbage, values_garbage, mask, gamma, lam, last_values)
    expected = torch.tensor(gae_weighted_sum(rewards.tolist(), values.tolist(), lengths, gamma, lam,
                                             last_values.tolist()), dtype=torch.float64)
    torch.testing.assert_close(adv, expected, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(ret, (expected + values) * mask, atol=1e-9, rtol=1e-9)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)


def test_lambda_zero_is_one_step_td_and_lambda_one_is_monte_carlo():
    lengths = [4, 2]
    mask = ragged_mask(lengths, 4)
    r = torch.tensor([[0.1, -0.2, 0.3, 1.0], [0.5, 2.0, 0.0, 0.0]], dtype=torch.float64)
    v = torch.tensor([[0.4, 0.3, 0.2, 0.1], [1.0, -1.0, 0.0, 0.0]], dtype=torch.float64)
    adv0, _ = gae(r, v, mask, 1.0, 0.0)
    td = torch.tensor([[0.1 + 0.3 - 0.4, -0.2 + 0.2 - 0.3, 0.3 + 0.1 - 0.2, 1.0 - 0.1],
                       [0.5 - 1.0 - 1.0, 2.0 + 1.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv0, td)
    adv1, ret1 = gae(r, v, mask, 1.0, 1.0)
    reward_to_go = torch.tensor([[1.2, 1.1, 1.3, 1.0], [2.5, 2.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(ret1, reward_to_go)  # MC: returns are the reward-to-go
    torch.testing.assert_close(adv1, (reward_to_go - v) * mask)


def test_truncation_bootstrap_and_length_one_rows():
    # A truncated row bootstraps from last_values; an EOS row uses 0; length-1 rows work.
    r = torch.tensor([[1.0], [1.0]])
    v = torch.tensor([[0.25], [0.25]])
    adv, ret = gae(r, v, torch.ones(2, 1), 1.0, 0.95, last_values=torch.tensor([0.0, 2.0]))
    torch.testing.assert_close(adv, torch.tensor([[0.75], [2.75]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0], [3.0]]))


def test_shaped_rewards_by_hand():
    kl = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.5, -0.5, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    out = shaped_rewards(torch.tensor([2.0, -1.0]), kl, 0.1, mask)
    expected = torch.tensor([[-0.01, -0.02, -0.03 + 2.0, 0.0], [-0.05, 0.05 - 1.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)


def test_shaped_rewards_beta_zero_is_score_only():
    mask = ragged_mask([3, 1], 3).float()
    out = shaped_rewards(torch.tensor([1.5, 4.0]), torch.randn(2, 3), 0.0, mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 1.5], [4.0, 0.0, 0.0]]))


def test_whiten_uses_valid_tokens_only():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -100.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.float64)
    out = whiten(x, mask, eps=0.0)
    valid = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    mu, sd = valid.mean(), valid.std(unbiased=False)
    expected = torch.tensor([[(1 - mu) / sd, (2 - mu) / sd, 0.0], [(3 - mu) / sd, (4 - mu) / sd, 0.0]],
                            dtype=torch.float64)
    torch.testing.assert_close(out, expected)
    kept = whiten(x, mask, shift_mean=False, eps=0.0)
    torch.testing.assert_close(kept, (expected + mu) * mask)
    assert abs(masked_mean(out, mask).item()) < 1e-12


def whiten_reference(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Two-pass whitening in Python floats with exact sums (math.fsum): the mean of the valid elements, then the
    mean of their squared deviations from it; (x − μ)/sqrt(σ² + eps) on valid elements, 0 elsewhere."""
    valid = [float(v) for v in x[mask.bool()].tolist()]
    mu = math.fsum(valid) / len(valid)
    var = math.fsum((v - mu) ** 2 for v in valid) / len(valid)
    scale = 1.0 / math.sqrt(var + eps)
    return torch.tensor([[(float(v) - mu) * scale if m else 0.0 for v, m in zip(row, mrow)]
                         for row, mrow in zip(x.tolist(), mask.bool().tolist())], dtype=torch.float64)


def offset_batch(offset: float, spread: float, rows: int = 8, T: int = 64, seed: int = 0):
    """float32 (rows, T) values offset + spread·N(0, 1) and a ragged mask (lengths 1..T)."""
    g = torch.Generator().manual_seed(seed)
    x = (offset + spread * torch.randn(rows, T, generator=g, dtype=torch.float64)).float()
    lengths = torch.randint(1, T + 1, (rows,), generator=g)
    return x, (torch.arange(T)[None, :] < lengths[:, None]).float()


@pytest.mark.parametrize("offset, spread", [(100.0, 0.1), (1000.0, 0.1), (3000.0, 1.0), (-250.0, 0.01), (0.0, 1.0)])
def test_whiten_matches_two_pass_float64_at_large_offsets(offset, spread):
    """Issue #42: E[x²] − mean² in float32 cancelled (offset 100 / spread 0.1: std 1.19; 1000 / 0.1: 1.43; 3000 / 1:
    variance 0, ×10⁴). REINFORCE++ whitens raw returns, which sit at such offsets with a log-likelihood score."""
    x, mask = offset_batch(offset, spread)
    out = whiten(x, mask)
    assert out.dtype == torch.float32
    expected = whiten_reference(x, mask)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6)
    kept = out.double()[mask.bool()]
    # std 1 up to eps's share: sqrt(σ² / (σ² + 1e-8)) = 0.99995 at spread 0.01
    assert kept.std(unbiased=False).item() == pytest.approx(expected[mask.bool()].std(unbiased=False).item(), abs=1e-6)
    assert kept.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)
    assert abs(kept.mean().item()) < 1e-5


def whiten_on(rank: int, world_size: int, port: int, out) -> None:
    """Process ``rank`` whitens its half of the rows (ragged: the token counts differ) with distributed=True."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world_size)
    try:
        x, mask = offset_batch(3000.0, 1.0)
        half = len(x) // world_size
        rows = slice(rank * half, (rank + 1) * half)
        out.put((rank, whiten(x[rows], mask[rows], distributed=True)))
    finally:
        torch.distributed.destroy_process_group()


def test_distributed_whiten_pools_all_ranks_tokens_two_pass():
    """Two gloo processes, each with 4 of the 8 rows at offset 3000 / spread 1: each whitens over both processes'
    valid tokens, so the halves put together equal the float64 two-pass reference on all rows."""
    parts = spawn_gloo(whiten_on, 2)
    x, mask = offset_batch(3000.0, 1.0)
    assert mask[:4].sum() != mask[4:].sum()  # per-rank means of means would differ from the pooled figure
    torch.testing.assert_close(torch.cat([parts[0], parts[1]]).double(), whiten_reference(x, mask), rtol=0, atol=2e-6)


def test_masked_mean_empty_is_zero_not_nan():
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0
