"""The no-op metrics (issue 54): their pure functions against values computed by hand, and a tiny PPO step that logs
them — a real update moves the weights by exactly the norm of what changed, a learning rate of 0 by nothing, and an
engine that misses its weight sync lags the trainer by one version."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import make_policy_dir, make_prompts_file, tiny_config

from tether.core.stats import nonzero_counts, squared_change
from tether.ppo.noop import EVERY_STEP_ELEMENTS, WeightVersions, measured_at
from tether.ppo.setup import setup
from tether.ppo.step import ppo_step


def test_squared_change_by_hand():
    before = [torch.tensor([1.0, 2.0]), torch.tensor([[0.5]])]
    after = [torch.tensor([1.0, 5.0]), torch.tensor([[-0.5]])]
    assert float(squared_change(before, after)) == 3.0 ** 2 + 1.0 ** 2  # (5 − 2)² + (−0.5 − 0.5)²
    assert float(squared_change(before, before)) == 0.0
    with pytest.raises(ValueError):
        squared_change(before, after[:1])


def test_nonzero_counts_by_hand():
    # a group of three alike (0.3 − their mean rounds to ~1e-17, not 0), one real advantage, a padded token
    x = torch.tensor([[0.3 - (0.3 + 0.3 + 0.3) / 3, 0.25, 7.0]])
    mask = torch.tensor([[1, 1, 0]])
    nonzero, total = nonzero_counts(x, mask)
    assert (int(nonzero), int(total)) == (1, 2)
    nonzero, _ = nonzero_counts(torch.tensor([[float("nan"), 0.0]]), torch.ones(1, 2))
    assert int(nonzero) == 1  # a NaN is not "no signal"


def test_measured_every_step_for_small_models_and_sparsely_for_large_ones():
    assert all(measured_at(s, 10_000) for s in range(1, 30))
    big = EVERY_STEP_ELEMENTS + 1
    assert [s for s in range(1, 31) if measured_at(s, big)] == [1, 2, 10, 20, 30]


def test_versions_lag_when_the_engine_misses_a_sync():
    v = WeightVersions()
    v.synced()
    assert v.metrics(True) == {"rollout/weight_version": 0, "rollout/weight_lag": 0}
    v.trained(updates=4, norm=0.3)
    v.synced()
    assert v.metrics(True)["rollout/weight_lag"] == 0
    v.trained(updates=4, norm=None)  # not measured this step: applied updates count
    assert v.metrics(True) == {"rollout/weight_version": 1, "rollout/weight_lag": 1}  # no sync since
    v.trained(updates=4, norm=0.0)  # updates that moved nothing are no new version
    v.trained(updates=0, norm=None)
    assert v.trainer == 2 and v.metrics(False) == {}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("noop")
    return make_policy_dir(root), make_prompts_file(root)


@pytest.mark.parametrize("lora_r", [0, 4])
def test_a_step_logs_the_exact_change_of_the_trainable_weights(files, tmp_path, lora_r):
    cfg = tiny_config(tmp_path, *files, model__lora_r=lora_r)
    run = setup(cfg)
    before = [p.detach().clone() for p in run.optim.policy_params]
    metrics = ppo_step(run, cfg, 1)
    by_hand = math.sqrt(sum(float(((p.detach().double() - b.double()) ** 2).sum())
                            for p, b in zip(run.optim.policy_params, before)))
    assert by_hand > 0 and metrics["ppo/param_update_norm"] == pytest.approx(by_hand, rel=1e-9)
    assert 0 < metrics["advantages/nonzero_fraction"] <= 1
    assert "rollout/weight_lag" not in metrics  # the transformers engine samples with the trained module itself
    assert run.versions.trainer == 1


def test_a_learning_rate_of_zero_moves_nothing_and_a_missed_sync_lags(files, tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, *files, model__lora_r=4)
    run = setup(cfg)
    for group in run.optim.policy_optimizer.param_groups:  # what a broken schedule or frozen adapter amounts to
        group["lr"] = 0.0
    run.optim.policy_scheduler.lr_lambdas = [lambda _: 0.0] * len(run.optim.policy_optimizer.param_groups)
    assert ppo_step(run, cfg, 1)["ppo/param_update_norm"] == 0.0
    assert run.versions.trainer == 0

    run = setup(cfg)
    monkeypatch.setattr(type(run.models.engine), "syncs_weights", True)  # an engine holding its own weights ...
    monkeypatch.setattr(run.models.engine, "sync_weights", lambda model: None)
    first = ppo_step(run, cfg, 1)
    assert (first["rollout/weight_version"], first["rollout/weight_lag"]) == (0, 0)
    run.versions.synced = lambda: None  # ... whose sync never arrives
    second = ppo_step(run, cfg, 2)
    assert (second["rollout/weight_version"], second["rollout/weight_lag"]) == (0, 1)
