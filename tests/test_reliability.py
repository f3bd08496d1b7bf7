"""Crash safety (B14) and non-finite values (B16) on tiny runs: restart in place, cut-short log lines,
fsync order, time-based checkpoints, rows with NaN/Inf scores or failing rules dropped from the update,
skipped optimizer steps, the stop after K skipped steps, and no NaN weight ever written."""

import json
import os

import pytest
import torch
from tiny import make_policy_dir, make_prompts_file, tiny_config

import tether.checkpoint as checkpoint_module
import tether.ppo.step as step_module
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


@pytest.mark.parametrize("rule", ["nan_some", "inf_some", "raises_some"])
def test_rows_with_bad_scores_are_dropped_and_the_run_goes_on(files, tmp_path, rule):
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
    expected = "raised ValueError: cannot parse this reply" if rule == "raises_some" else "non-finite score"
    assert expected in dropped[0] and "row " in dropped[0]


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


def test_a_nan_logit_skips_that_update_only(files, tmp_path, monkeypatch):
    real = step_module.forward_response
    calls = {"n": 0}

    def once_nan(model, batch, temperature, need_hidden=False):
        logprobs, entropy, hidden = real(model, batch, temperature, need_hidden)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == 1:  # the first training forward: NaN log-probs, as from a NaN logit
                logprobs = logprobs + float("nan")
        return logprobs, entropy, hidden

    monkeypatch.setattr(step_module, "forward_response", once_nan)
    cfg = tiny_config(tmp_path, *files, steps=2)
    run = train(cfg)
    got = rows(run)
    assert got[0]["health/skipped_updates"] == 1 and got[1]["health/skipped_updates"] == 0
    assert got[0]["ppo/updates"] == cfg.ppo.epochs * cfg.ppo.mini_batches - 1 or got[0]["ppo/early_stopped"]
    assert weights_finite(run)


def test_k_skipped_steps_stop_the_run_and_keep_the_last_checkpoint(files, tmp_path, monkeypatch):
    real = step_module.forward_response

    def nan_after_step_1(model, batch, temperature, need_hidden=False):
        logprobs, entropy, hidden = real(model, batch, temperature, need_hidden)
        if torch.is_grad_enabled() and state["broken"]:
            logprobs = logprobs * float("nan")
        return logprobs, entropy, hidden

    state = {"broken": False}
    real_step = step_module.ppo_step
    import tether.ppo.train as train_module

    def step_then_break(run, cfg, step):
        state["broken"] = step >= 2
        return real_step(run, cfg, step)

    monkeypatch.setattr(step_module, "forward_response", nan_after_step_1)
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
    from tether.ppo.train import export_policy

    cfg = tiny_config(tmp_path, *files)
    run = setup(cfg)
    with torch.no_grad():
        next(run.models.unwrapped_policy.parameters())[0] = float("nan")
    with pytest.raises(TetherError, match="holds NaN/Inf; not saved"):
        save_checkpoint(tmp_path / "run", 1, run.models.unwrapped_policy, run.models.unwrapped_critic, {}, 2)
    with pytest.raises(TetherError, match="holds NaN/Inf; not saved"):
        export_policy(run, tmp_path / "run")
    assert not list_checkpoints(tmp_path / "run") and not (tmp_path / "run" / "policy").exists()
