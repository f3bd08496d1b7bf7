"""K samples per prompt and the critic-free estimators in the PPO step (SPEC B17) on tiny models: groups sampled
together and kept together in minibatches, no critic built or checkpointed, value metrics absent, exact resume
for every estimator, the KL as a loss term, Dr. GRPO's constant-length normalisation, 2 processes = 1, bad
settings refused, the plan's three models, and the doctor naming a run whose groups are all alike."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from launcher import accelerate_launch
from tiny import make_policy_dir, make_prompts_file, tiny_config

import tether.ppo.step as step_module
import tether.ppo.update as update_module
from tether.cli import main
from tether.core.group import CRITIC_FREE
from tether.errors import ConfigError
from tether.ppo.setup import setup
from tether.ppo.step import ppo_step
from tether.ppo.train import train

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("group")
    return make_policy_dir(root), make_prompts_file(root)


def rows_of(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("k", [1, 3])
def test_each_prompt_is_sampled_k_times_in_adjacent_rows(files, tmp_path, monkeypatch, k):
    cfg = tiny_config(tmp_path, *files, batch_size=4, samples_per_prompt=k, ppo__mini_batches=2)
    run = setup(cfg)
    expected = copy.deepcopy(run.data.prompts).next_batch()  # the stream's next 4 prompts
    seen = []
    original = step_module.rollout_batch

    def spy(models, cfg_, rows, greedy=False):
        seen.append([r["prompt"] for r in rows])
        return original(models, cfg_, rows, greedy)

    monkeypatch.setattr(step_module, "rollout_batch", spy)
    metrics = ppo_step(run, cfg, 1)
    assert seen[0] == [r["prompt"] for r in expected for _ in range(k)]  # K = 1: the rows as they always were
    assert any(key.startswith("group/") for key in metrics) == (k > 1)


def test_minibatches_hold_whole_groups(files, tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, *files, batch_size=4, samples_per_prompt=2, ppo__mini_batches=2, ppo__epochs=2,
                      ppo__early_stop=False, advantage__estimator="rloo")
    run = setup(cfg)
    queries = []
    original = update_module.minibatch_update

    def spy(run_, cfg_, minibatch, critic_only):
        queries.append([tuple(q.tolist()) for q in minibatch.rollout.query])
        return original(run_, cfg_, minibatch, critic_only)

    monkeypatch.setattr(update_module, "minibatch_update", spy)
    ppo_step(run, cfg, 1)
    assert len(queries) == 4 and all(len(q) == 4 for q in queries)  # 2 epochs x 2 minibatches of 2 groups
    for minibatch in queries:  # every prompt in a minibatch comes with its K = 2 samples
        assert all(minibatch.count(q) % 2 == 0 for q in minibatch)


@pytest.mark.parametrize("estimator,kl_in", [("rloo", "reward"), ("grpo", "loss"), ("dr_grpo", "reward"),
                                             ("reinforce_pp", "loss")])
def test_critic_free_runs_build_no_critic_and_resume_exactly(files, tmp_path, estimator, kl_in):
    from safetensors.torch import load_file

    def config(root, steps):
        return tiny_config(root, *files, steps=steps, save_every=1, batch_size=4, samples_per_prompt=2,
                           advantage__estimator=estimator, kl__penalty_in=kl_in, kl__controller="adaptive",
                           model__lora_r=4 if estimator == "grpo" else 0)

    straight = config(tmp_path / "a", 3)
    run = setup(straight)
    assert run.models.critic is None and run.optim.critic_optimizer is None  # no critic built
    train(straight)
    first = config(tmp_path / "b", 1)
    train(first)
    resumed = copy.deepcopy(first)
    resumed.steps = 3
    train(resumed, resume=True)
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert rows_of(a) == rows_of(b)
    wa, wb = load_file(str(a / "policy" / "model.safetensors")), load_file(str(b / "policy" / "model.safetensors"))
    assert all(torch.equal(wa[key], wb[key]) for key in wa)
    checkpoint = sorted((b / "checkpoints").iterdir())[-1]
    assert sorted(p.name for p in checkpoint.iterdir()) == ["policy", "trainer_state.pt"]  # no critic file
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    assert state["critic_optimizer"] is None and state["critic_scheduler"] is None
    row = rows_of(a)[-1]
    assert not any(key.startswith("value/") for key in row)  # absent, not zero
    assert {"group/no_spread_fraction", "group/reward_spread", "policy/loss"} <= row.keys()
    assert ("policy/kl_loss" in row) == (kl_in == "loss")
    if kl_in == "loss":  # the reward holds the score alone: no −β·KL_t on its tokens
        assert all(r["objective/rlhf_reward"] == pytest.approx(r["objective/scores"], abs=1e-6) for r in rows_of(a))


def test_kl_as_a_loss_term_is_the_k3_token_mean_times_beta(files, tmp_path, monkeypatch):
    """The reference 0.5 nat below the policy on every token: k3 = e^−0.5 − 1 + 0.5 per token, whatever the
    advantages; with zero advantages the loss is β·k3 alone (ratio 1 on the first minibatch)."""
    cfg = tiny_config(tmp_path, *files, batch_size=4, samples_per_prompt=2, ppo__mini_batches=1,
                      advantage__estimator="grpo", kl__penalty_in="loss", kl__coef=0.3)
    run = setup(cfg)
    captured = {}
    original = update_module.minibatch_loss

    def spy(run_, cfg_, mb, critic_only, weight):
        mb = type(mb)(**{**mb.__dict__, "logprobs_ref": mb.logprobs_old - 0.5,
                         "advantages": torch.zeros_like(mb.advantages)})
        stats = original(run_, cfg_, mb, critic_only, weight)
        captured.setdefault("first", stats)
        return stats

    monkeypatch.setattr(update_module, "minibatch_loss", spy)
    ppo_step(run, cfg, 1)
    k3 = math.exp(-0.5) - 1 + 0.5
    assert captured["first"]["policy/kl_loss"] == pytest.approx(k3, rel=1e-5)
    assert captured["first"]["policy/loss"] == 0.0


def test_dr_grpo_gradient_is_the_surrogate_summed_over_rows_times_max_new_tokens(files, tmp_path, monkeypatch):
    """One minibatch of 8 rows in 4 micro-batches: the gradient the optimiser clips equals that of
    −Σ_tokens A_t·ρ_t / (8 · max_new_tokens), computed here directly at ρ = 1 (not a token mean)."""
    from tether.ppo.forward import forward_response

    cfg = tiny_config(tmp_path, *files, batch_size=4, samples_per_prompt=2, ppo__mini_batches=1, ppo__epochs=1,
                      ppo__grad_accumulation=4, advantage__estimator="dr_grpo", optim__max_grad_norm=0)
    run = setup(cfg)
    params = run.optim.policy_params
    seen, grads = {}, []
    clip, ppo_epochs = torch.nn.utils.clip_grad_norm_, step_module.ppo_epochs

    def record(parameters, max_norm, *args, **kwargs):
        grads.append([q.grad.detach().clone() for q in parameters])
        return clip(parameters, max_norm, *args, **kwargs)

    def keep(run_, cfg_, experience, step):
        seen.update(experience=experience, weights=[q.detach().clone() for q in params])
        return ppo_epochs(run_, cfg_, experience, step)

    monkeypatch.setattr(step_module, "ppo_epochs", keep)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", record)
    ppo_step(run, cfg, 1)
    experience = seen["experience"]
    with torch.no_grad():  # back to the weights the update started from
        for q, before in zip(params, seen["weights"]):
            q.copy_(before)
    run.models.policy_model.zero_grad()
    with torch.enable_grad():
        logprobs, _, _ = forward_response(run.models.policy_model, experience.rollout, cfg.generation.temperature)
        ratio = torch.exp(logprobs - experience.logprobs_old)
        mask = experience.response_mask.float()
        (-(experience.advantages * ratio * mask).sum() / (8 * cfg.generation.max_new_tokens)).backward()
    assert len(grads) == 1  # one update, and no critic: the policy's clip only
    for got, q in zip(grads[0], params):
        torch.testing.assert_close(got, q.grad, rtol=1e-4, atol=1e-8)


@pytest.mark.slow
def test_two_processes_give_the_advantages_of_one(tmp_path):
    import subprocess
    import sys

    one = tmp_path / "one.pt"
    subprocess.run([sys.executable, str(HERE / "group_worker.py"), str(one)], check=True, cwd=HERE.parent,
                   env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    two = tmp_path / "two.pt"
    accelerate_launch([str(HERE / "group_worker.py"), str(two)], processes=2)
    a, b = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    for estimator in CRITIC_FREE:
        for x, y in zip(a[estimator], b[estimator]):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    assert a["metrics"] == pytest.approx(b["metrics"])
    assert 0 < a["metrics"]["group/no_spread_fraction"] < 1 and a["metrics"]["group/solved_fraction"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("config", [None, "fsdp2.yaml"], ids=["ddp", "fsdp2"])
def test_two_processes_train_and_checkpoint_without_a_critic(files, tmp_path, config):
    """2 gloo processes (DDP, or FSDP2 from the accelerate config), GRPO with K = 2: no critic wrapped, sharded,
    gathered or saved; the ranks' weights agree (DDP); the group metrics are pooled into one row per step."""
    policy, prompts = files
    out = tmp_path / "run"
    accelerate_launch(["-m", "tether", "ppo", "--policy", str(policy), "--prompts", str(prompts), "--reward",
                       "tether.rules:char_share", "--output-dir", str(out), "--steps", "2", "--batch-size", "2",
                       "--mini-batches", "2", "--max-new-tokens", "5", "--progress", "false", "--save-every", "1",
                       "--advantage", "grpo", "--samples-per-prompt", "2"], config=config)
    assert sorted(p.name for p in (out / "checkpoints" / "step_000002").iterdir()) == ["policy", "trainer_state.pt"]
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [0, 1, 2]  # the default step-0 held-out evaluation, then the steps
    assert all("group/no_spread_fraction" in r for r in rows[1:])
    if config is None:
        assert json.loads((out / "ranks.json").read_text())["in_sync"] is True


def test_the_group_estimators_refuse_one_sample_per_prompt_and_a_critic_warmup(files, tmp_path):
    with pytest.raises(ConfigError, match="--samples-per-prompt of at least 2"):
        tiny_config(tmp_path, *files, advantage__estimator="grpo")
    with pytest.raises(ConfigError, match="no critic to warm up"):
        tiny_config(tmp_path, *files, advantage__estimator="reinforce_pp", critic__warmup_steps=2)
    tiny_config(tmp_path, *files, advantage__estimator="reinforce_pp")  # REINFORCE++ needs no groups


def test_cli_bad_estimator_settings_are_one_line_exit_2(files, tmp_path, capsys):
    policy, prompts = files
    args = ["ppo", "--policy", str(policy), "--prompts", str(prompts), "--reward", "tether.rules:char_share",
            "--output-dir", str(tmp_path / "run")]
    assert main(args + ["--advantage", "rloo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--advantage rloo" in err[0] and "--samples-per-prompt" in err[0]
    assert main(args + ["--advantage", "ppo"]) == 2
    assert "--advantage" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_dry_run_counts_three_models_without_a_critic(files, tmp_path, capsys):
    policy, prompts = files
    args = ["ppo", "--policy", str(policy), "--prompts", str(prompts), "--reward", "tether.rules:char_share",
            "--output-dir", str(tmp_path / "run"), "--dry-run", "--batch-size", "4"]
    assert main(args + ["--advantage", "grpo", "--samples-per-prompt", "4"]) == 0
    printed = capsys.readouterr().out
    table = [line.split()[1] if line.startswith(("rollout", "train")) else line.split()[0]
             for line in printed.splitlines() if line.strip().startswith(("rollout", "train", "reference", "RM",
                                                                           "critic", "actor"))]
    assert "critic" not in table and {"actor", "reference", "RM"} <= set(table)
    assert "batch 16/GPU" in printed  # 4 prompts × 4 samples
    assert main(args) == 0
    assert "critic" in capsys.readouterr().out.split("static")[0]  # GAE: the critic's rows are there


def test_doctor_names_a_run_whose_groups_are_all_alike(files, tmp_path, capsys):
    """A planted run: a constant reward gives every group of K samples the same score. The reward gives no signal at
    all: the doctor's flat-reward check ranks first, its prescription the reward itself; the groups' alarm follows."""
    cfg = tiny_config(tmp_path, *files, steps=4, batch_size=4, samples_per_prompt=2, advantage__estimator="grpo",
                      reward__sources=["bad_rules:constant"])
    run_dir = train(cfg)
    rows = rows_of(run_dir)
    assert all(r["group/no_spread_fraction"] == 1.0 for r in rows if r["step"] > 0)  # (step 0: an evaluation)
    capsys.readouterr()  # the run's own lines
    assert main(["doctor", str(run_dir), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert (d["level"], d["failure_mode"], d["cause_metric"]) == ("UNHEALTHY", "no reward signal",
                                                                   "objective/scores_raw")
    assert d["prescriptions"][0]["action"].startswith("the reward gives no signal: check the reward function")
    # what follows from it: no group has spread, so every advantage is 0 and no weight moved (the no-op checks)
    assert sorted(c["failure_mode"] for c in d["evidence"]["chain"]) == [
        "no signal in the groups", "the run trains nothing (advantages all zero)",
        "the run trains nothing (weights unchanged)"]
    assert not any(b.startswith(("value_loss", "explained_variance")) for b in d["unchecked"])
    assert main(["report", str(run_dir), "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "Groups of K samples with no score spread" in page and "grpo, K = 2" in page


@pytest.mark.parametrize("k3_clip", [None, 0.0])
def test_the_k3_loss_term_is_clipped_at_kl_k3_clip(files, tmp_path, monkeypatch, k3_clip):
    """The reference 12 nats above the policy on every token: k3 = e^12 − 13 = 162741.79 per token, clipped to 10
    by default (veRL, OpenRLHF); --kl-k3-clip 0 (TRL) leaves it whole."""
    clip = {} if k3_clip is None else {"kl__k3_clip": k3_clip}
    cfg = tiny_config(tmp_path, *files, batch_size=4, samples_per_prompt=2, ppo__mini_batches=1,
                      advantage__estimator="grpo", kl__penalty_in="loss", kl__coef=0.3, **clip)
    run = setup(cfg)
    captured = {}
    original = update_module.minibatch_loss

    def spy(run_, cfg_, mb, critic_only, weight):
        mb = type(mb)(**{**mb.__dict__, "logprobs_ref": mb.logprobs_old + 12.0})
        stats = original(run_, cfg_, mb, critic_only, weight)
        captured.setdefault("first", stats)
        return stats

    monkeypatch.setattr(update_module, "minibatch_loss", spy)
    ppo_step(run, cfg, 1)
    expected = 10.0 if k3_clip is None else math.exp(12.0) - 13.0
    assert captured["first"]["policy/kl_loss"] == pytest.approx(expected, rel=1e-5)
