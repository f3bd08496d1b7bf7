"""Log-probs, entropy, explained variance, Wilson interval, repetition rate, import lightness."""

import math
import subprocess
import sys

import pytest
import torch

from tether import entropy_from_logits, explained_variance, logprobs_from_logits, wilson_interval
from tether.core.stats import repetition_rate


def test_wilson_16_of_20():
    low, high = wilson_interval(16, 20)
    assert low == pytest.approx(0.584, abs=5e-4) and high == pytest.approx(0.919, abs=5e-4)


def test_wilson_edges():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and 0 < high < 0.35
    low, high = wilson_interval(10, 10)
    assert high == 1.0 and 0.65 < low < 1


def test_logprobs_and_entropy_from_logits_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # probs [0.25, 0.75]
    assert logprobs_from_logits(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.75))
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(logits).item() == pytest.approx(h)


def test_logprobs_match_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * 5
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    ref = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(logprobs_from_logits(logits, tokens), ref)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns.clone(), returns, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask).item() == pytest.approx(0.0)
    v = returns - torch.tensor([[0.5, 0.0, -0.5, 0.0]])  # Var(R-V) = 1/6, Var(R) = 2/3 -> 0.75
    assert explained_variance(v, returns, mask).item() == pytest.approx(0.75)


def test_repetition_rate():
    tokens = torch.tensor([[1, 2, 1, 2, 1, 2, 9], [5, 6, 7, 8, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0]])
    # row 0 bigrams: 12 21 12 21 12 -> 5 grams, 2 distinct; row 1: 56 67 78 -> 3 distinct
    assert repetition_rate(tokens, mask, n=2) == pytest.approx(3 / 8)


def test_import_tether_does_not_import_transformers():
    code = "import sys, tether; tether.gae; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_mcnemar_exact_by_hand():
    from tether.core.stats import mcnemar_exact

    assert mcnemar_exact(0, 0) == 1.0
    # 5 vs 0 discordant: p = 2 * (1/32) = 0.0625
    assert mcnemar_exact(5, 0) == pytest.approx(0.0625)
    # 10 vs 2: P[X <= 2] for Bin(12, 1/2) = (1 + 12 + 66) / 4096
    assert mcnemar_exact(2, 10) == pytest.approx(2 * 79 / 4096)
    assert mcnemar_exact(3, 3) == 1.0
