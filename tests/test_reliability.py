"""Crash safety (B14) and non-finite values (B16) on tiny runs: restart in place, cut-short log lines,
fsync order, time-based checkpoints, rows with NaN/Inf scores or failing rules dropped from the update,
skipped optimizer steps, the stop after K skipped steps, and no NaN weight ever written."""

import json
import math
import os

import pytest
import torch
from tiny import make_policy_dir, make_prompts_file, tiny_config

import tether.checkpoint as checkpoint_module
import tether.ppo.step as step_module
import tether.ppo.update as update_module
from tether.checkpoint import list_checkpoints, save_checkpoint
from tether.errors import TetherError
from tether.ppo.train import train


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    return make_policy_dir(root), make_prompts_file(root)


def rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def weights_finite(run):
    from safetensors.torch import load_file

    weights = load_file(str(run / "policy" / "model.safetensors"))
    return all(torch.isfinite(w).all() for w in weights.values())


def test_run_killed_before_its_first_checkpoint_starts_again_in_place(files, tmp_path, capsys):
    cfg = tiny_config(tmp_path, *files, steps=2)
    run = train(cfg)
    straight = rows(run)
    # What a kill before the first checkpoint leaves: metrics rows, samples, no checkpoint.
    for path in list_checkpoints(run):
        import shutil
        shutil.rmtree(path)
    (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text() + '{"step": 3, "objective/sc')
    train(cfg)  # a plain start: allowed, replaces the old rows
    assert "has no complete checkpoint; starting from step 0 in place (replacing 3 metric rows)" \
        in capsys.readouterr().err
    assert [r["step"] for r in rows(run)] == [1, 2]
    for path in list_checkpoints(run):
        import shutil
        shutil.rmtree(path)
    train(cfg, resume=True)  # --resume with nothing to resume from: the same fresh start
    assert "has no complete checkpoint" in capsys.readouterr().err
    drop_perf = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows(run)]
    assert drop_perf == [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in straight]
    with pytest.raises(TetherError, match="already holds a run; use --resume"):
        train(cfg)  # a run with a checkpoint is never overwritten by a plain start


def test_cut_short_last_lines_are_dropped_on_resume(files, tmp_path):
    cfg = tiny_config(tmp_path, *files, steps=2, save_every=1)
    run = train(cfg)
    metrics = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_bytes(metrics.encode() + b'{"step": 3, "objective/scores": 0.\xe2')
    (run / "alerts.jsonl").write_text('{"step": 1, "alert": "x"}\n{"step": 2, "al')
    cfg.steps = 3
    train(cfg, resume=True)
    assert [r["step"] for r in rows(run)] == [1, 2, 3]
    assert (run / "alerts.jsonl").read_text().splitlines()[0] == '{"step": 1, "alert": "x"}'
    # A damaged line that is not the last one is not guessed at: one line naming the file and the line.
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "obj\n{"step": 3}\n')
    cfg.steps = 4
    with pytest.raises(TetherError, match=r"metrics.jsonl: line 2 is not a JSON row"):
        train(cfg, resume=True)


def test_checkpoint_files_then_folder_then_parent_are_fsynced(files, tmp_path, monkeypatch):
    synced = []
    real = checkpoint_module.fsync_path
    monkeypatch.setattr(checkpoint_module, "fsync_path", lambda p: (synced.append(str(p)), real(p)))
    cfg = tiny_config(tmp_path, *files, steps=1)
    run = train(cfg)
    ckpt = list_checkpoints(run)[0]
    tmp_names = [s for s in synced if ".tmp-step_000001" in s]
    assert any(s.endswith("trainer_state.pt") for s in tmp_names)
    assert any(s.endswith("critic.safetensors") for s in tmp_names)
    last_file = max(i for i, s in enumerate(synced) if s.endswith("trainer_state.pt"))
    folder = synced.index(next(s for s in tmp_names if s.endswith(".tmp-step_000001-" + str(os.getpid()))))
    assert last_file < folder  # the files' data before the folder's entries
    assert synced.index(str(ckpt.parent), folder) > folder  # the rename, made durable in the parent


def test_checkpoints_by_time_are_on_by_default(files, tmp_path):
    from tether.ppo.config import RunConfig

    assert RunConfig().save_every_minutes == 10.0
    cfg = tiny_config(tmp_path, *files, steps=3, save_every_minutes=1e-9, keep_checkpoints=5)
    run = train(cfg)
    assert [p.name for p in list_checkpoints(run)] == ["step_000001", "step_000002", "step_000003"]


@pytest.mark.parametrize("rule", ["nan_some", "inf_some", "raises_some", "none_some", "garbage_some"])
def test_rows_with_bad_scores_are_dropped_and_the_run_goes_on(files, tmp_path, rule):
    """B16 (#38 item 5, #42 item 3): NaN, ±Inf, an exception on a row, TRL's None ("does not apply"), a string or a
    list in place of a number — each costs its row (counted in health/dropped_rows, named in alerts), never the run."""
    cfg = tiny_config(tmp_path, *files, steps=3, reward__sources=[f"bad_rules:{rule}"],
                      reward__normalize="batch")
    run = train(cfg)
    got = rows(run)
    assert sum(r["health/dropped_rows"] for r in got) > 0
    assert all(r["ppo/updates"] > 0 and r["health/skipped_updates"] == 0 for r in got)
    for r in got:  # every number the run wrote is finite
        assert all(torch.isfinite(torch.tensor(float(v))) for k, v in r.items()), r
    assert weights_finite(run)
    alerts = [json.loads(line)["alert"] for line in (run / "alerts.jsonl").read_text().splitlines()]
    dropped = [a for a in alerts if a.startswith("dropped ")]
    assert len(dropped) == sum(1 for r in got if r["health/dropped_rows"] > 0)
    expected = {"raises_some": ["raised ValueError: cannot parse this reply"],
                "none_some": ["no reward judged it (returned None (does not apply))"],
                "garbage_some": ["raised ValueError: cannot parse this reply", "returned 'n/a' (str), not a number",
                                 "returned [1.0] (list), not a number"]}.get(rule, ["non-finite score"])
    assert all(any(text in a for a in dropped) for text in expected), dropped
    assert "row " in dropped[0]


def test_dropped_rows_leave_the_update(files, tmp_path, monkeypatch):
    """A dropped row has no tokens in the loss: its advantages are 0 and the whitening ignores it."""
    from tether.ppo.setup import setup

    seen = []
    real = step_module.ppo_epochs
    monkeypatch.setattr(step_module, "ppo_epochs",
                        lambda run, cfg, e, step: (seen.append(e), real(run, cfg, e, step))[1])
    cfg = tiny_config(tmp_path, *files, reward__sources=["bad_rules:nan_some"])
    run = setup(cfg)
    metrics = step_module.ppo_step(run, cfg, 1)
    e = seen[0]
    bad = ~e.valid
    assert bad.any() and metrics["health/dropped_rows"] == bad.sum().item()
    assert e.response_mask[bad].sum() == 0 and e.rollout.response_mask[bad].sum() > 0
    assert (e.advantages[bad] == 0).all() and (e.scores[bad] == 0).all()
    mask = e.response_mask.bool()
    assert abs(e.advantages[mask].mean().item()) < 1e-5  # whitened over the kept tokens only


def test_a_trl_style_none_leaves_its_rows_out_of_a_grpo_update(files, tmp_path, monkeypatch):
    """TRL's None ("does not apply") → NaN → the row is dropped (B16): no advantage, no place in its group's
    statistics; the step runs. The rows are the ones the function itself returns None for."""
    from bad_rules import none_some

    from tether.ppo.setup import setup

    seen, prompts_seen = [], []
    real_epochs, real_rollout = step_module.ppo_epochs, step_module.rollout_batch
    monkeypatch.setattr(step_module, "ppo_epochs",
                        lambda run, cfg, e, step: (seen.append(e), real_epochs(run, cfg, e, step))[1])
    monkeypatch.setattr(step_module, "rollout_batch", lambda models, cfg, rows, greedy=False: (
        prompts_seen.append([r["prompt"] for r in rows]), real_rollout(models, cfg, rows, greedy))[1])
    cfg = tiny_config(tmp_path, *files, reward__sources=["bad_rules:none_some"], advantage__estimator="grpo",
                      samples_per_prompt=2, batch_size=8)
    run = setup(cfg)
    metrics = step_module.ppo_step(run, cfg, 1)
    e = seen[0]
    none_rows = torch.tensor([v is None for v in none_some(prompts_seen[0], [""] * len(prompts_seen[0]))])
    assert none_rows.any() and not none_rows.all()
    assert torch.equal(~e.valid, none_rows) and metrics["health/dropped_rows"] == none_rows.sum().item()
    assert (e.advantages[none_rows] == 0).all() and (e.scores[none_rows] == 0).all()
    assert metrics["ppo/updates"] > 0


def test_a_nan_logit_skips_that_update_only(files, tmp_path, monkeypatch):
    real = update_module.forward_response
    calls = {"n": 0}

    def once_nan(model, batch, temperature, **kwargs):
        logprobs, entropy, hidden = real(model, batch, temperature, **kwargs)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == 1:  # the first training forward: NaN log-probs, as from a NaN logit
                logprobs = logprobs + float("nan")
        return logprobs, entropy, hidden

    monkeypatch.setattr(update_module, "forward_response", once_nan)
    cfg = tiny_config(tmp_path, *files, steps=2)
    run = train(cfg)
    got = rows(run)
    assert got[0]["health/skipped_updates"] == 1 and got[1]["health/skipped_updates"] == 0
    assert got[0]["ppo/updates"] == cfg.ppo.epochs * cfg.ppo.mini_batches - 1 or got[0]["ppo/early_stopped"]
    assert weights_finite(run)


def test_k_skipped_steps_stop_the_run_and_keep_the_last_checkpoint(files, tmp_path, monkeypatch):
    real = update_module.forward_response

    def nan_after_step_1(model, batch, temperature, **kwargs):
        logprobs, entropy, hidden = real(model, batch, temperature, **kwargs)
        if torch.is_grad_enabled() and state["broken"]:
            logprobs = logprobs * float("nan")
        return logprobs, entropy, hidden

    state = {"broken": False}
    real_step = step_module.ppo_step
    import tether.ppo.train as train_module

    def step_then_break(run, cfg, step):
        state["broken"] = step >= 2
        return real_step(run, cfg, step)

    monkeypatch.setattr(update_module, "forward_response", nan_after_step_1)
    monkeypatch.setattr(train_module, "ppo_step", step_then_break)
    cfg = tiny_config(tmp_path, *files, steps=10, save_every=1, health__max_skipped_steps=3)
    with pytest.raises(TetherError, match=r"step 4: 3 consecutive steps skipped every optimizer update"):
        train(cfg)
    run = tmp_path / "run"
    assert [r["ppo/updates"] == 0 for r in rows(run)] == [False, True, True, True]
    assert not (run / "policy").exists()
    from safetensors.torch import load_file

    kept = load_file(str(list_checkpoints(run)[-1] / "policy" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in kept.values())


def test_a_nan_weight_is_never_written(files, tmp_path):
    from tether.ppo.setup import setup
    from tether.ppo.export import export_policy

    cfg = tiny_config(tmp_path, *files)
    run = setup(cfg)
    with torch.no_grad():
        next(run.models.unwrapped_policy.parameters())[0] = float("nan")
    with pytest.raises(TetherError, match="holds NaN/Inf; not saved"):
        save_checkpoint(tmp_path / "run", 1, run.models.unwrapped_policy, run.models.unwrapped_critic, {}, 2)
    with pytest.raises(TetherError, match="holds NaN/Inf; not saved"):
        export_policy(run, tmp_path / "run")
    assert not list_checkpoints(tmp_path / "run") and not (tmp_path / "run" / "policy").exists()


def lr_multiplier(schedule: str, k: int, warmup: int, total: int) -> float:
    """transformers' linear / cosine schedules with linear warm-up, by hand: the LR of optimizer update k
    (0-based) over ``total`` updates is base × k/warmup while k < warmup, then base × (1 − p) (linear) or
    base × ½(1 + cos πp) (cosine), p = (k − warmup)/(total − warmup)."""
    if k < warmup:
        return k / warmup
    progress = (k - warmup) / (total - warmup)
    return max(0.0, 1.0 - progress) if schedule == "linear" else max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def record_update_lrs(monkeypatch) -> dict[float, list[float]]:
    """Every optimizer update's LR, read from its param group right before the step applies it, keyed by the
    optimizer's base LR (the policy's and the critic's differ in the tests below)."""
    import tether.ppo.setup as setup_module

    seen: dict[float, list[float]] = {}
    real_adamw = setup_module.adamw

    def recording_adamw(params, lr, o):
        optimizer = real_adamw(params, lr, o)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.setdefault(lr, []).append(
            opt.param_groups[0]["lr"]))
        return optimizer

    monkeypatch.setattr(setup_module, "adamw", recording_adamw)
    return seen


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_resume_with_more_steps_follows_the_new_schedule(files, tmp_path, monkeypatch, schedule):
    """A 2-step run decays its LR to 0 at its last update; resumed with --steps 3, the updates follow the
    schedule of the 3-step run from where the first one stopped (never LR 0 for the first of them)."""
    seen = record_update_lrs(monkeypatch)
    lr, critic_lr, warmup = 1e-3, 2e-3, 2
    cfg = tiny_config(tmp_path, *files, steps=2, save_every=2, optim__schedule=schedule, optim__warmup_steps=warmup,
                      optim__lr=lr, optim__critic_lr=critic_lr, ppo__epochs=2, ppo__early_stop=False)
    per_step = cfg.ppo.epochs * cfg.ppo.mini_batches  # 4 updates a step, none skipped
    run = train(cfg)
    for base in (lr, critic_lr):  # the hand formula is transformers' schedule: checked on the first run
        assert seen[base] == pytest.approx([base * lr_multiplier(schedule, k, warmup, 2 * per_step)
                                            for k in range(2 * per_step)], rel=1e-9)
    seen.clear()
    cfg.steps = 3
    train(cfg, resume=True)
    for base in (lr, critic_lr):  # first update after the resume: linear 0.4 × base, cosine 0.345 × base
        expected = [base * lr_multiplier(schedule, k, warmup, 3 * per_step) for k in range(2 * per_step, 3 * per_step)]
        assert seen[base][0] > 0 and seen[base] == pytest.approx(expected, rel=1e-9), (base, seen[base][:3])
    # The logged LR is the one the step's updates used (their mean), not the next update's.
    logged = rows(run)[2]
    assert logged["policy/lr"] == pytest.approx(sum(seen[lr][:per_step]) / per_step, rel=1e-6)
    assert logged["value/lr"] == pytest.approx(sum(seen[critic_lr][:per_step]) / per_step, rel=1e-6)


def test_resume_within_a_decaying_schedule_equals_the_straight_run(files, tmp_path, monkeypatch):
    """Killed at step 3 of 3 (checkpoint at 2) and resumed with the same --steps: every update's LR and every
    metric row equal the straight run's, bit for bit, under a linear decay."""
    import tether.ppo.train as train_module

    class Killed(Exception):
        pass

    seen = record_update_lrs(monkeypatch)
    settings = dict(steps=3, save_every=2, optim__schedule="linear", optim__warmup_steps=3, optim__lr=1e-3,
                    optim__critic_lr=2e-3, ppo__epochs=2, ppo__early_stop=False)
    straight = train(tiny_config(tmp_path / "a", *files, **settings))
    straight_lrs = {base: lrs[8:] for base, lrs in seen.items()}  # the 4 updates of step 3
    real_step = train_module.ppo_step

    def killed_at_step_3(run, cfg, step):
        if step == 3:
            raise Killed  # what a kill leaves: the step-2 checkpoint, no row for step 3
        return real_step(run, cfg, step)

    monkeypatch.setattr(train_module, "ppo_step", killed_at_step_3)
    cfg = tiny_config(tmp_path / "b", *files, **settings)
    with pytest.raises(Killed):
        train(cfg)
    monkeypatch.setattr(train_module, "ppo_step", real_step)
    seen.clear()
    resumed = train(cfg, resume=True)
    assert seen == straight_lrs and len(seen[1e-3]) == 4
    drop_perf = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows(resumed)]
    assert drop_perf == [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows(straight)]


def poisoned_rows(input_ids: torch.Tensor, token: int) -> torch.Tensor:
    """(B,) bool: the rows whose input holds ``token`` — a NaN keyed to a row's content, as an fp16 overflow on
    one sequence is, so that it recurs in every forward of that row (scoring and training alike)."""
    return (input_ids == token).any(dim=1)


@pytest.mark.parametrize("path", ["logits", "own_head", "packed"])
def test_a_row_with_a_nan_logit_is_dropped_and_every_update_still_applies(files, tmp_path, path):
    """B16 at the shape that shows it: a NaN logit in the rows holding a '9' recurs in the training forward, where
    masking multiplies (0·NaN = NaN). Before the fix, with one minibatch per step, every update was skipped and
    the run stopped at step 3; the dropped rows must leave the training forwards, not only the loss weights.
    On each forward path: the model's logits, the output embedding on the last hidden states (the NaN planted
    there), and packed rows (where a NaN activation can reach the other units of its packed row through attention —
    0·NaN in the weighted sum — so they are dropped too: safe, and said in docs/reliability.md)."""
    import unittest.mock

    from transformers import AutoTokenizer

    import tether.ppo.setup as setup_module

    from tether.ppo.forward import ForwardOptions

    cfg = tiny_config(tmp_path, *files, steps=4, ppo__mini_batches=1, health__max_skipped_steps=3,
                      ppo__packing=path == "packed")
    nine = AutoTokenizer.from_pretrained(files[0]).convert_tokens_to_ids("9")

    real_setup = setup_module.setup

    def setup_with_a_nan_logit(cfg, *given):
        run = real_setup(cfg, *given)
        if path == "logits":
            run.models.forward = ForwardOptions()
        assert run.models.forward.own_head == (path != "logits")

        def nan_logit(module, args, kwargs, output):
            if kwargs.get("use_cache") is False:  # the scoring and training forwards, not generation
                bad = poisoned_rows(kwargs["input_ids"], nine)
                logits = output.logits.clone()
                logits[bad, 0, 0] = float("nan")  # position 0 predicts the first response token: always valid
                output["logits"] = logits
                if output.get("hidden_states") is not None:  # the output embedding's input: every position
                    last = output.hidden_states[-1].clone()
                    last[bad] = float("nan")
                    output["hidden_states"] = (*output.hidden_states[:-1], last)
            return output

        run.models.unwrapped_policy.register_forward_hook(nan_logit, with_kwargs=True)
        return run

    with unittest.mock.patch.object(setup_module, "setup", setup_with_a_nan_logit):
        run = train(cfg)
    got = rows(run)
    assert len(got) == 4 and all(r["health/dropped_rows"] > 0 for r in got)
    assert [(r["health/skipped_updates"], r["ppo/updates"] > 0) for r in got] == [(0, True)] * 4
    alerts = [json.loads(line)["alert"] for line in (run / "alerts.jsonl").read_text().splitlines()]
    assert sum(a.startswith("dropped ") and "non-finite log-prob or value" in a for a in alerts) == 4
    assert weights_finite(run)


def test_a_nan_bootstrap_value_drops_its_row_only(files, tmp_path, monkeypatch):
    """V(s_T) of a truncated row bootstraps its return (B7): a NaN there (here in the rows holding a '9') used to
    escape the finite check (0 rows dropped) and turn every advantage NaN through GAE and whitening."""
    from tether.ppo.setup import setup

    cfg = tiny_config(tmp_path, *files, generation__max_new_tokens=2)
    run = setup(cfg)
    nine = run.models.tokenizer.convert_tokens_to_ids("9")
    real = step_module.critic_values

    scored = []

    def nan_at_s_T(critic, batch, hidden):
        scored.append(batch)
        values = real(critic, batch, hidden).clone()
        values[poisoned_rows(batch.query, nine), -1] = float("nan")
        return values

    seen = []
    real_epochs = step_module.ppo_epochs
    monkeypatch.setattr(step_module, "critic_values", nan_at_s_T)
    monkeypatch.setattr(step_module, "ppo_epochs", lambda run, cfg, e, step: (seen.append(e),
                                                                              real_epochs(run, cfg, e, step))[1])
    metrics = step_module.ppo_step(run, cfg, 1)
    e, rollout = seen[0], scored[0]
    bad = poisoned_rows(rollout.query, nine) & ~rollout.ended_with_eos
    assert 0 < int(bad.sum()) < len(bad), "the test needs some truncated rows with a '9' and some without"
    assert metrics["health/dropped_rows"] == int(bad.sum()) and (e.valid == ~bad).all()
    assert all(torch.isfinite(t).all() for t in (e.advantages, e.returns, e.last_values))
    assert metrics["health/skipped_updates"] == 0 and metrics["ppo/updates"] > 0
    assert "non-finite bootstrap value V(s_T)" in metrics["health/notes"][0]


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_every_schedule_warms_up_then_follows_its_shape(files, tmp_path, schedule):
    """The schedules resume relies on, against the hand formula: optim.warmup_steps warms up every schedule,
    the constant one included (transformers' 'constant' alone would ignore the warm-up)."""
    from types import SimpleNamespace

    from tether.ppo.setup import make_optimisation

    cfg = tiny_config(tmp_path, *files, steps=3, optim__schedule=schedule, optim__warmup_steps=3, optim__lr=1e-3)
    total = cfg.steps * cfg.ppo.epochs * cfg.ppo.mini_batches
    policy, critic = SimpleNamespace(model=torch.nn.Linear(2, 2)), torch.nn.Linear(2, 1)
    optim = make_optimisation(cfg, policy, critic, SimpleNamespace(grad_scaler=lambda: None))
    lrs = []
    for _ in range(total):
        lrs.append(optim.policy_optimizer.param_groups[0]["lr"])
        optim.policy_optimizer.step()
        optim.policy_scheduler.step()
    flat = schedule == "constant"
    assert lrs == pytest.approx([1e-3 * (min(k / 3, 1.0) if flat else lr_multiplier(schedule, k, 3, total))
                                 for k in range(total)], rel=1e-9)


def test_a_run_saved_before_ppo_target_kl_resumes_only_with_its_early_stop(files, tmp_path):
    """Runs saved before ppo.target_kl stopped their epochs at early_stop_factor × kl.target: resuming one with
    another kl.target than 0.01 must name ppo.target_kl, or its epochs would stop elsewhere than they did."""
    import yaml

    from tether.config import config_to_dict, save_config
    from tether.ppo.resume import check_same_config

    cfg = tiny_config(tmp_path, *files, kl__target=0.05)
    (tmp_path / "run").mkdir()
    old = config_to_dict(cfg)
    del old["ppo"]["target_kl"]
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(old), encoding="utf-8")
    with pytest.raises(TetherError, match=r"--resume: ppo.target_kl is 0.01 but the run in .* was made with 0.05"):
        check_same_config(cfg, tmp_path / "run")
    cfg.ppo.target_kl = 0.05
    check_same_config(cfg, tmp_path / "run")  # the same early stop: resumes
    save_config(cfg, tmp_path / "run" / "config.yaml")  # a run saved with the key: checked as any other key
    check_same_config(cfg, tmp_path / "run")


def test_a_run_saved_before_kl_k3_clip_resumes_only_unclipped_if_it_used_k3(files, tmp_path):
    """Runs saved before kl.k3_clip (#42) never clipped k3: resuming one that used k3 (kl.estimator k3 or
    --kl-in loss) with the new default 10 would change its training, so --kl-k3-clip 0 is asked for; a run that
    used k1 resumes as it is."""
    import yaml

    from tether.config import config_to_dict
    from tether.ppo.resume import check_same_config

    for estimator, penalty_in, refused in [("k3", "reward", True), ("k1", "loss", True), ("k1", "reward", False)]:
        cfg = tiny_config(tmp_path, *files, kl__estimator=estimator, kl__penalty_in=penalty_in)
        (tmp_path / "run").mkdir(exist_ok=True)
        old = config_to_dict(cfg)
        del old["kl"]["k3_clip"]
        (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(old), encoding="utf-8")
        if refused:
            with pytest.raises(TetherError, match=r"--resume: kl.k3_clip is 10.0 but the run in .* was made with 0.0"):
                check_same_config(cfg, tmp_path / "run")
            cfg.kl.k3_clip = 0.0
        check_same_config(cfg, tmp_path / "run")


def test_a_gold_rule_that_fails_on_rows_costs_those_rows_not_the_evaluation(files, tmp_path):
    """#38 item 5: the gold rule raising on a row, returning None, a string or +Inf: that row is not correct and
    counted in eval/gold_failed, its sample says why; the other rows are judged as usual. Expected values from the
    rule's own row kinds (prompt index mod 5: 0 raises, 1 +Inf, 2 "yes", 3 None, 4 correct)."""
    from bad_rules import _index

    from tether.ppo.evaluate import evaluate
    from tether.ppo.setup import setup

    cfg = tiny_config(tmp_path, *files, eval__n=8, data__eval_fraction=0.25, reward__gold="bad_rules:gold_some")
    metrics, samples = evaluate(setup(cfg), cfg, 0)
    kinds = [i % 5 for i in _index([s["prompt"] for s in samples])]
    assert len(samples) == 8 and 0 < kinds.count(4) < 8 and len(set(kinds)) >= 3
    assert metrics["eval/gold_failed"] == sum(k != 4 for k in kinds)
    assert metrics["eval/accuracy"] == kinds.count(4) / 8
    assert metrics["eval/correct"] == "".join("1" if k == 4 else "0" for k in kinds)
    why = {0: "raised ValueError: cannot verify this reply", 1: "returned inf", 2: "returned 'yes' (str), not a number",
           3: "returned None (does not apply)"}
    assert [s.get("gold_failed") for s in samples] == [why.get(k) for k in kinds]
    assert [s["correct"] for s in samples] == [k == 4 for k in kinds]


def test_judge_gold_by_hand():
    """+Inf and NaN are no verdict: not correct, failed; 0 and 1 are verdicts."""
    from types import SimpleNamespace

    from tether.ppo.evaluate import judge_gold

    cfg = SimpleNamespace(reward=SimpleNamespace(gold="python:g"))
    verdicts, failed = judge_gold(cfg, lambda p, r: [1.0, math.inf, 0.0, math.nan, None], list("abcde"), list("abcde"),
                                  {}, None)
    assert verdicts[[0, 2]].tolist() == [1.0, 0.0] and torch.isnan(verdicts[[1, 3, 4]]).all()
    assert failed == {1: "returned inf", 3: "returned nan", 4: "returned None (does not apply)"}
    assert judge_gold(cfg, None, ["a"], ["b"], {}, None) == (None, {})


def test_a_gold_rule_of_the_wrong_length_is_one_line_naming_gold(files, tmp_path):
    from tether.ppo.evaluate import evaluate
    from tether.ppo.setup import setup

    cfg = tiny_config(tmp_path, *files, eval__n=8, data__eval_fraction=0.25, reward__gold="bad_rules:wrong_length")
    with pytest.raises(TetherError, match=r"^--gold bad_rules:wrong_length: rule wrong_length: returned 9 scores for "
                                          r"8 responses$"):
        evaluate(setup(cfg), cfg, 0)

