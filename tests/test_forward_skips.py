"""Forwards a step leaves out (issue 53 item 2, tether/ppo/skips.py) and packing by default (item 3).

Each skip against the full computation, one step both ways from the same seed on the tiny GPT-2: the gradient of
every trainable parameter and the metrics that must agree, to float rounding; the forwards counted by a spy. The
cases where a skip must not apply are refused (the separate pass still runs, and says why at start-up)."""

import copy
from dataclasses import replace

import pytest
import torch
from tiny import make_policy_dir, make_prompts_file, tiny_config

import tether.ppo.draw as draw_module
import tether.ppo.step as step_module
import tether.ppo.update as update_module
from tether.diagnostics.doctor import diagnose
from tether.ppo.setup import setup
from tether.ppo.skips import plan_skips
from tether.ppo.step import ppo_step

K = 4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("skips")
    return make_policy_dir(root), make_prompts_file(root, n=40)


def _grpo(tmp_path, files, name, **overrides):
    settings = {"samples_per_prompt": K, "advantage__estimator": "grpo", "batch_size": 4, "ppo__mini_batches": 1,
                    "ppo__epochs": 1, "generation__max_new_tokens": 5}
    return tiny_config(tmp_path / name, *files, **{**settings, **overrides})


def _one_step(cfg, monkeypatch, step_patch=None):
    """Set up, count the rows of every scoring forward (old and reference log-probs: step.py) and training forward
    (update.py), run step 1; returns the metrics, the gradients of every trainable parameter, and the counts."""
    run = setup(cfg)
    rows = {"score": [], "train": []}
    for module, key in ((step_module, "score"), (update_module, "train")):
        original = module.forward_response

        def counted(model, rollout, *args, _original=original, _key=key, **kwargs):
            rows[_key].append(len(rollout))
            return _original(model, rollout, *args, **kwargs)

        monkeypatch.setattr(module, "forward_response", counted)
    if step_patch is not None:
        step_patch(monkeypatch)
    metrics = ppo_step(run, cfg, 1)
    monkeypatch.undo()
    grads = {f"{owner}.{n}": p.grad.detach().clone()
             for owner, model in (("policy", run.models.unwrapped_policy), ("critic", run.models.unwrapped_critic))
             if model is not None for n, p in model.named_parameters() if p.requires_grad}
    return metrics, grads, rows


def _assert_same_grads(a: dict, b: dict):
    assert a.keys() == b.keys() and len(a) > 0
    assert sum(float(g.abs().sum()) for g in a.values()) > 0  # an update happened: something to compare
    for name, grad in a.items():
        torch.testing.assert_close(b[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def _assert_same(metrics_a: dict, metrics_b: dict, keys):
    for k in keys:
        assert k in metrics_a and k in metrics_b, k
        assert metrics_b[k] == pytest.approx(metrics_a[k], abs=1e-6, rel=1e-4), k


# (a) log π_old from the training forward ------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["kl_in_loss", "beta0_grad_accumulation", "separate_critic"])
def test_old_logprobs_from_the_training_forward_equal_the_separate_pass(files, tmp_path, monkeypatch, case):
    """One epoch of one minibatch: the same loss, gradients and metrics as the separate old-log-prob pass, with
    one scoring forward fewer (GRPO with the KL as a loss term; β = 0 over two micro-batches; GAE on a separate
    critic with β = 0, whose reference pass is skipped both ways)."""
    overrides = {"kl_in_loss": {"kl__penalty_in": "loss", "kl__coef": 0.1},
                 "beta0_grad_accumulation": {"kl__coef": 0.0, "ppo__grad_accumulation": 2, "ppo__entropy_coef": 0.01},
                 "separate_critic": {"advantage__estimator": "gae", "critic__kind": "separate", "kl__coef": 0.0,
                                         "samples_per_prompt": 1, "batch_size": 8}}[case]
    full = _grpo(tmp_path, files, "full", ppo__old_logprobs="forward", **overrides)
    skip = _grpo(tmp_path, files, "skip", **overrides)
    assert plan_skips(skip, critic_is_head=False).old_logprobs
    m_full, g_full, rows_full = _one_step(full, monkeypatch)
    m_skip, g_skip, rows_skip = _one_step(skip, monkeypatch)
    assert len(rows_skip["score"]) == len(rows_full["score"]) - 1  # the old-log-prob pass is gone
    assert rows_skip["train"] == rows_full["train"]
    _assert_same_grads(g_full, g_skip)
    keys = ["objective/scores", "objective/rlhf_reward", "policy/loss", "policy/entropy", "policy/grad_norm",
            "policy/ratio_mean", "policy/clip_fraction", "ppo/updates"]
    keys += {"kl_in_loss": ["objective/kl", "objective/kl_sequence", "policy/kl_loss"],
             "separate_critic": ["value/loss", "value/mean", "value/explained_variance"]}.get(case, [])
    _assert_same(m_full, m_skip, keys)
    assert m_skip["policy/ratio_mean"] == 1.0 and m_skip["policy/ratio_max"] == 1.0  # exactly, by construction
    assert m_skip["policy/clip_fraction"] == 0.0


@pytest.mark.parametrize("overrides, reason", [
    ({"ppo__epochs": 2}, "ppo.epochs 2"),
    ({"ppo__mini_batches": 2}, "ppo.mini_batches 2"),
    ({"kl__coef": 0.05}, "per-token KL in the reward"),
    ({"advantage__estimator": "gae", "samples_per_prompt": 1, "batch_size": 8, "kl__coef": 0.0}, "value head"),
    ({"kl__coef": 0.0, "correction__mode": "tis"}, "--rollout-correction tis"),
    ({"kl__coef": 0.0, "model__lora_r": 4, "model__lora_dropout": 0.1}, "--lora-dropout"),
    ({"kl__coef": 0.0, "ppo__old_logprobs": "forward"}, "ppo.old_logprobs forward"),
])
def test_old_logprobs_pass_kept_where_something_needs_it(files, tmp_path, overrides, reason):
    cfg = _grpo(tmp_path, files, "refused", **{"kl__penalty_in": "reward", **overrides})
    skips = plan_skips(cfg, critic_is_head=cfg.advantage.estimator == "gae")
    assert not skips.old_logprobs and reason in skips.old_reason


def test_two_epochs_run_the_old_pass_and_say_why_at_start_up(files, tmp_path, monkeypatch, capsys):
    """Refused in a real step: with 2 epochs (or β > 0 in the reward) the old and reference passes both run; the
    one-epoch, one-minibatch run blocked by the KL in its reward says why in one start-up line."""
    _, _, rows = _one_step(_grpo(tmp_path, files, "two", ppo__epochs=2, kl__coef=0.0, kl__reference="always"),
                           monkeypatch)
    assert len(rows["score"]) == 2
    _, _, rows = _one_step(_grpo(tmp_path, files, "beta", kl__coef=0.05), monkeypatch)
    assert len(rows["score"]) == 2
    err = capsys.readouterr().err
    assert "note: old log-probs: a separate forward, because the per-token KL in the reward" in err


# (c) the reference pass at β = 0 ------------------------------------------------------------------------------

@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_reference_skipped_at_beta_zero_gives_the_same_update(files, tmp_path, monkeypatch, estimator):
    """β = 0 throughout (kl.coef 0, fixed, --kl-in reward) and two epochs of two minibatches (the old pass runs):
    without the reference pass the gradients and metrics are those of the run that computed it, and the KL
    metrics are left out, not written as 0."""
    shape = {"ppo__epochs": 2, "ppo__mini_batches": 2, "kl__coef": 0.0}
    if estimator == "gae":
        shape.update(advantage__estimator="gae", samples_per_prompt=1, batch_size=8)
    full = _grpo(tmp_path, files, "always", kl__reference="always", **shape)
    skip = _grpo(tmp_path, files, "auto", **shape)
    m_full, g_full, rows_full = _one_step(full, monkeypatch)
    m_skip, g_skip, rows_skip = _one_step(skip, monkeypatch)
    assert len(rows_full["score"]) == 2 and len(rows_skip["score"]) == 1
    _assert_same_grads(g_full, g_skip)
    _assert_same(m_full, m_skip, ["objective/scores", "objective/rlhf_reward", "objective/kl_coef", "policy/loss",
                                  "policy/entropy", "policy/grad_norm", "policy/approx_kl", "ppo/updates"])
    kl_keys = ("objective/kl", "objective/kl_max", "objective/kl_p99", "objective/kl_sequence")
    assert all(k in m_full for k in kl_keys) and not any(k in m_skip for k in kl_keys)


@pytest.mark.parametrize("overrides", [{"kl__coef": 0.05}, {"kl__coef": 0.05, "kl__penalty_in": "loss"},
                                       {"kl__coef": 0.0, "kl__penalty_in": "loss"},
                                       {"kl__coef": 0.05, "kl__controller": "adaptive"},
                                       {"kl__coef": 0.0, "kl__reference": "always"}])
def test_reference_pass_kept_where_the_kl_is_used_or_asked(files, tmp_path, overrides):
    cfg = _grpo(tmp_path, files, "ref", **{"ppo__epochs": 2, **overrides})
    assert not plan_skips(cfg, critic_is_head=False).reference


def test_the_doctor_raises_no_alarm_for_a_kl_not_computed():
    """A β = 0 run without a reference pass logs objective/kl_coef and no objective/kl: the KL bands are neither
    alarms nor 'not checked', and the not-learning band (gated on KL < 0.01) does not read a missing KL as 0 —
    the same rows with a KL of 0.001 logged do raise it, so the band is live."""
    rows = [{"step": s, "objective/kl_coef": 0.0, "objective/scores": 0.1 + 0.001 * s, "policy/clip_fraction": 0.0,
             "policy/entropy": 2.0, "policy/approx_kl": 0.0, "policy/ratio_std": 0.0, "response/length_mean": 5.0}
            for s in range(1, 41)]
    d = diagnose(rows, run_config={"kl": {"coef": 0.0}, "advantage": {"estimator": "grpo"}})
    assert d.cause_band is None and not {"kl_mean", "kl_max"} & set(d.unchecked)
    logged = diagnose([{**r, "objective/kl": 0.001} for r in rows],
                      run_config={"kl": {"coef": 0.0}, "advantage": {"estimator": "grpo"}})
    assert logged.cause_band == "not_learning"


# (d) no forward over a short step's filler rows -----------------------------------------------------------------

class _AsIfTwoProcesses:
    """The run's processes as dynamic sampling sees them with a second process: a short batch keeps its shape with
    weightless filler rows (draw._filled); every reduction is still this one process's."""

    def __init__(self, p):
        self._p, self.world_size = p, 2

    def __getattr__(self, name):
        return getattr(self._p, name)


def test_a_short_step_alone_equals_its_computation_with_filler_rows(files, tmp_path, monkeypatch):
    """--filter-groups short of groups (max_rounds 0), one process: the forwards see the groups with spread only,
    and the update equals the one computed with the filler rows in place (as several processes keep them)."""
    from difficulty_rules import is_flat

    from tether.ppo.prompts import PromptStream, load_prompts

    rows_all = load_prompts(str(files[1]))
    seed = next(s for s in range(50)
                if 0 < sum(not is_flat(r["prompt"]) for r in PromptStream(rows_all, 4, s).next_batch()) < 4)
    cfg = _grpo(tmp_path, files, "short", seed=seed, difficulty__filter_groups=True, difficulty__max_rounds=0,
                reward__sources=["difficulty_rules:flat_for_even"], data__eval_fraction=0.0, eval__every=0)
    original = draw_module._filled

    def with_filler(monkeypatch):
        monkeypatch.setattr(draw_module, "_filled", lambda run, *a: original(
            replace(run, processes=_AsIfTwoProcesses(run.processes)), *a))

    m_alone, g_alone, rows_alone = _one_step(copy.deepcopy(cfg), monkeypatch)
    m_fill, g_fill, rows_fill = _one_step(cfg, monkeypatch, step_patch=with_filler)
    kept = int(m_alone["filter/groups_kept"]) * K
    assert 0 < kept < 4 * K
    assert rows_alone["score"] == [kept, kept] and rows_alone["train"] == [kept]
    assert rows_fill["score"] == [4 * K, 4 * K] and rows_fill["train"] == [4 * K]
    _assert_same_grads(g_fill, g_alone)
    _assert_same(m_fill, m_alone, ["objective/scores", "objective/kl", "policy/loss", "policy/entropy",
                                   "policy/grad_norm", "filter/groups_kept", "filter/groups_short"])


# packing by default --------------------------------------------------------------------------------------------

def test_packing_on_by_default_for_groups_and_one_flag_away(files, tmp_path):
    import argparse

    from tether.config import resolve_config
    from tether.hf import load_causal_lm
    from tether.ppo.cli import add_arguments
    from tether.ppo.config import RunConfig
    from tether.ppo.forward import resolved_forward_options

    assert setup(_grpo(tmp_path, files, "k4", ppo__epochs=2)).models.forward.packing
    assert not setup(_grpo(tmp_path, files, "k1", advantage__estimator="reinforce_pp", samples_per_prompt=1,
                           ppo__epochs=2)).models.forward.packing
    assert not setup(_grpo(tmp_path, files, "off", ppo__packing=False, ppo__epochs=2)).models.forward.packing
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for argv, packing in ([], None), (["--no-packing"], False), (["--packing"], True), (["--packing", "false"], False):
        args = parser.parse_args(["--policy", "p", "--prompts", "x.jsonl", "--reward", "m:f", *argv])
        assert resolve_config(RunConfig, args).ppo.packing is packing, argv
    # a model whose packed rows are not exact: the default falls back to padded rows and says so; asked, refused
    model = load_causal_lm(files[0])

    class IgnoresTheMask(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.config = model, model.config

        def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
            return self.inner(input_ids=input_ids, **kwargs)

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

    cfg = _grpo(tmp_path, files, "check")
    options, lines = resolved_forward_options(cfg, False, IgnoresTheMask())
    assert not options.packing and "packing off" in lines[0]
    with pytest.raises(Exception, match="ppo.packing"):
        resolved_forward_options(replace(cfg, ppo=replace(cfg.ppo, packing=True)), False, IgnoresTheMask())
