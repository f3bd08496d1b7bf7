"""Issue #51's dynamic-sampling, curriculum and throughput findings, each at the shape where it was found: steps with
no group with spread do not stop the run (B16 counts non-finite stalls only); ties are judged on the scores the
estimator sees (B4 applied, the running moments untouched); the curriculum draws once per step for all processes,
without replacement across rounds, one visit per prompt per step (two real processes; one process with
max_rounds > 1), and wraps around when a step needs more prompts than there are; throughput counts every round's
generated tokens and no forward runs over filler rows on one process."""

import copy
import json

import pytest
import torch
from difficulty_rules import K, filter_cfg
from launcher import accelerate_launch
from tiny import make_policy_dir, make_prompts_file, tiny_config

from tether.core.flops import generation_flops
from tether.ppo.curriculum import Curriculum
from tether.ppo.draw import draw_step_batch
from tether.ppo.perf import PhaseTimer
from tether.ppo.setup import setup
from tether.ppo.step import ppo_step, sample_batch
from tether.ppo.train import train


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("dynamic")
    return make_policy_dir(root), make_prompts_file(root, n=40)


_cfg = filter_cfg


def _recording(run, cfg, step, rounds):
    """``sample()`` for draw_step_batch that keeps every round's sampled batch in ``rounds``."""
    def sample():
        batch = sample_batch(run, cfg, step, PhaseTimer())
        rounds.append(batch)
        return batch
    return sample


def _groups_with_equal(values: torch.Tensor) -> torch.Tensor:
    """(G,) bool: groups of K adjacent values all equal."""
    v = values.reshape(-1, K)
    return (v == v[:, :1]).all(dim=1)


# Finding 1: a false stop.

def test_steps_with_no_group_with_spread_do_not_stop_the_run(files, tmp_path):
    """Every group flat (all solved) for 4 steps with health.max_skipped_steps 3: nothing was non-finite, so the run
    ends normally (it stopped at step 3 with "3 consecutive steps skipped every optimizer update")."""
    cfg = _cfg(tmp_path, files, reward="difficulty_rules:always_flat", difficulty__max_rounds=0, steps=4,
               save_every=0, health__max_skipped_steps=3, eval__every=0)
    rows = [json.loads(line) for line in (train(cfg) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["ppo/updates"] == 0 and r["health/skipped_updates"] == 0 for r in rows)
    assert all("health/non_finite_stall" not in r for r in rows)  # popped by the run loop, not a metric


def test_steps_with_no_finite_row_still_stop_the_run(files, tmp_path):
    """The streak still counts steps whose every row is non-finite (a broken reward) under --filter-groups."""
    from tether.errors import TetherError

    cfg = _cfg(tmp_path, files, reward="dynamic_sampling_rules:always_nan", difficulty__max_rounds=0, steps=5,
               save_every=0, health__max_skipped_steps=3, eval__every=0)
    with pytest.raises(TetherError, match=r"step 3: 3 consecutive steps skipped every optimizer update"):
        train(cfg)


# Finding 2: ties judged on the scores the estimator sees.

def test_length_penalty_gives_right_replies_spread_and_the_filter_keeps_them(files, tmp_path):
    """Every reply right (raw 1.0, every group flat) with --length-penalty 0.1: a group's estimator scores are
    1 − 0.1·length, so the groups whose replies differ in length have spread and are kept (the raw judge dropped
    them all), and group/no_spread_fraction is the share of groups whose replies all have one length."""
    cfg = _cfg(tmp_path, files, reward="dynamic_sampling_rules:always_right", difficulty__max_rounds=0,
               reward__length_penalty=0.1, generation__max_new_tokens=8)
    run = setup(cfg)
    rounds = []
    batch = draw_step_batch(run, cfg, PhaseTimer(), _recording(run, cfg, 1, rounds))
    lengths = rounds[0].rollout.lengths.cpu()
    expected = (1.0 - 0.1 * lengths.float())
    torch.testing.assert_close(batch.drawn_scores, expected)
    equal = _groups_with_equal(lengths)
    assert 0 < int((~equal).sum()) < 4, "the seed must draw groups of both kinds"
    spread_prompts = [rounds[0].rows[g * K]["prompt"] for g in range(4) if not equal[g]]
    assert [r["prompt"] for r in batch.rows[::K]] == spread_prompts
    assert batch.metrics["filter/groups_kept"] == len(spread_prompts)

    run = setup(cfg)
    metrics = ppo_step(run, cfg, 1)
    assert metrics["group/no_spread_fraction"] == float(equal.float().mean())
    assert metrics["ppo/updates"] > 0


def test_scores_clipped_to_one_value_are_flat(files, tmp_path):
    """Raw 6, 7, 8, 9 in every group, clipped to 5 (reward.clip 5): no spread as the estimator sees it, so nothing
    is kept (the raw judge kept every group and trained on them with gradient norm 0)."""
    cfg = _cfg(tmp_path, files, reward="dynamic_sampling_rules:six_to_nine", difficulty__max_rounds=1,
               reward__clip=5.0)
    run = setup(cfg)
    metrics = ppo_step(run, cfg, 1)
    assert metrics["filter/groups_kept"] == 0 and metrics["filter/groups_short"] == 4
    assert metrics["filter/prompts_drawn"] == 8 and metrics["group/no_spread_fraction"] == 1.0
    assert metrics["ppo/updates"] == 0


def test_judging_ties_leaves_the_running_moments_alone(files, tmp_path):
    """Running normalisation: the rounds' judging reads a copy; the step updates the moments once, with the kept
    rows only (16 of the 3 rounds' 48)."""
    cfg = _cfg(tmp_path, files, difficulty__max_rounds=20, reward__normalize="running")
    run = setup(cfg)
    rounds = []
    batch = draw_step_batch(run, cfg, PhaseTimer(), _recording(run, cfg, 1, rounds))
    assert len(rounds) > 1 and run.data.running_scores.count == 0
    run = setup(cfg)
    ppo_step(run, cfg, 1)
    assert run.data.running_scores.count == 16
    kept = batch.rewards_raw.sequence.double()
    assert run.data.running_scores.mean == pytest.approx(float(kept.mean()))


# Findings 3 and 4: the curriculum.

def test_curriculum_rounds_of_one_step_draw_distinct_prompts_and_record_one_visit_each(files, tmp_path):
    """One process, every group flat, max_rounds 6: 7 rounds of 4 prompts from 40, all distinct (a fresh draw per
    round repeated prompts: 4 of 8 steps trained one prompt twice), and each drawn prompt one visit (pass rate 0)."""
    cfg = _cfg(tmp_path, files, reward="difficulty_rules:always_flat", difficulty__max_rounds=6,
               difficulty__curriculum=True)
    run = setup(cfg)
    rounds = []
    draw_step_batch(run, cfg, PhaseTimer(), _recording(run, cfg, 1, rounds))
    index = {id(row): i for i, row in enumerate(run.data.prompts.rows)}
    drawn = [index[id(row)] for b in rounds for row in b.rows[::K]]
    assert len(rounds) == 7 and len(drawn) == 28 and len(set(drawn)) == 28
    assert run.data.prompts.curriculum.visits == {i: [0.0] for i in drawn}


def test_a_prompt_drawn_twice_in_one_step_makes_one_visit():
    c = Curriculum(n_prompts=3, memory=2)
    c.record([0, 1, 0, 2], [1.0, 0.0, 0.5, 1.0])  # prompt 0 twice in the step (a wrap-around): one visit, 3/4
    assert c.visits == {0: [0.75], 1: [0.0], 2: [1.0]}


def test_curriculum_draw_wraps_around_each_prompt_once_per_pass():
    c = Curriculum(n_prompts=5, memory=1, min_weight=0.25)
    c.record([0, 1], [1.0, 0.0])
    for seed in range(20):
        out = c.draw(12, seed)
        assert len(out) == 12
        assert sorted(out[:5]) == [0, 1, 2, 3, 4] and sorted(out[5:10]) == [0, 1, 2, 3, 4]
    taken = torch.tensor([True, False, True, False, False])
    out = c.draw(4, 0, taken)  # 3 not taken, then a new pass
    assert sorted(out[:3]) == [1, 3, 4] and len(out) == 4


def test_curriculum_with_batch_size_above_the_prompts_trains(files, tmp_path):
    """--curriculum with --batch-size 8 over 5 training prompts: the draw wraps around as the plain stream does
    (it drew 5 rows and the update failed with IndexError)."""
    root = tmp_path / "few"
    root.mkdir()
    prompts = make_prompts_file(root, n=5)
    cfg = tiny_config(tmp_path, files[0], prompts, batch_size=8, steps=2, save_every=0, eval__every=0,
                      difficulty__curriculum=True, samples_per_prompt=2, advantage__estimator="rloo")
    rows = [json.loads(line) for line in (train(cfg) / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["ppo/updates"] == 2 * r["ppo/epochs_run"] > 0 for r in rows)  # 16 rows, 2 minibatches
    assert rows[-1]["curriculum/visited_prompts"] == 1.0


@pytest.mark.slow
def test_two_processes_never_share_a_prompt_within_a_step(files, tmp_path):
    """2 real processes (accelerate, gloo), --filter-groups --curriculum, max_rounds 2, 24 prompts: within each
    step no prompt is drawn twice over both processes and all rounds (each rank was seeded apart: 84 prompts over 50
    steps were trained on both), and every prompt's visits are the steps that drew it, the same table on both."""
    policy, _ = files
    prompts = make_prompts_file(tmp_path, n=24)
    out = tmp_path / "run"
    out.mkdir()
    steps = 4
    accelerate_launch(["tests/dynamic_sampling_worker.py", str(policy), str(prompts), str(out), str(steps)])
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["visits"] == ranks[1]["visits"]
    texts = ranks[0]["rows"]
    assert sorted(texts) == sorted(json.loads(line)["prompt"] for line in prompts.read_text().splitlines())
    steps_of = {}
    for step in range(steps):
        drawn = ranks[0]["drawn"][step] + ranks[1]["drawn"][step]
        assert len(drawn) % 8 == 0 and len(drawn) <= 24
        assert len(set(drawn)) == len(drawn), f"step {step + 1}: a prompt drawn twice"
        assert not set(ranks[0]["trained"][step]) & set(ranks[1]["trained"][step])
        for prompt in drawn:
            steps_of.setdefault(texts.index(prompt), []).append(step)
    assert {int(k): len(v) for k, v in ranks[0]["visits"].items()} == {i: len(s) for i, s in steps_of.items()}


# Finding 7: throughput under --filter-groups.

def test_throughput_counts_every_round_generated_and_the_kept_tokens(files, tmp_path):
    """perf/tokens_per_second is every round's generated tokens over the step's seconds, perf/kept_tokens_per_second
    the trained rows' tokens, and perf/mfu_generate every round's generation FLOPs over the generate seconds."""
    import tether.ppo.step as step_module

    cfg = _cfg(tmp_path, files, difficulty__max_rounds=20)
    run = setup(cfg)
    rounds, draw = [], step_module.draw_step_batch
    kept = []

    def recording(run_, cfg_, timer, sample):
        def sample_kept():
            batch = sample()
            rounds.append(batch)
            return batch
        batch = draw(run_, cfg_, timer, sample_kept)
        kept.append(batch)
        return batch

    step_module.draw_step_batch = recording
    try:
        m = ppo_step(run, cfg, 1)
    finally:
        step_module.draw_step_batch = draw
    assert m["filter/rounds"] >= 1
    generated = sum(int(b.rollout.lengths.sum()) for b in rounds)
    kept_tokens = int(kept[0].rollout.lengths[kept[0].kept.to(kept[0].rollout.lengths.device)].sum())
    assert kept_tokens < generated
    assert m["perf/tokens_per_second"] * m["perf/seconds_step"] == pytest.approx(generated, rel=1e-9)
    assert m["perf/kept_tokens_per_second"] * m["perf/seconds_step"] == pytest.approx(kept_tokens, rel=1e-9)
    flops = sum(generation_flops(run.perf.policy, int(q), int(r)) for b in rounds
                for q, r in zip(b.rollout.query_mask.sum(dim=1), b.rollout.lengths))
    assert m["perf/mfu_generate"] * m["perf/seconds_generate"] * run.perf.peak == pytest.approx(flops, rel=1e-9)


def _forward_rows(monkeypatch):
    """Rows of every scoring forward (old and reference log-probs) and training forward of the next step."""
    import tether.ppo.step as step_module
    import tether.ppo.update as update_module

    rows = {"score": [], "train": []}
    for module, key in ((step_module, "score"), (update_module, "train")):
        original = module.forward_response

        def counted(model, rollout, *args, _original=original, _key=key, **kwargs):
            rows[_key].append(len(rollout))
            return _original(model, rollout, *args, **kwargs)

        monkeypatch.setattr(module, "forward_response", counted)
    return rows


def test_a_short_step_alone_runs_no_forward_over_filler_rows(files, tmp_path, monkeypatch):
    """One process, max_rounds 0, a draw of 4 groups of which some are flat: the old, reference and training
    forwards see only the groups with spread (they computed all 16 rows, the filler weighing nothing)."""
    from difficulty_rules import is_flat

    from tether.ppo.prompts import PromptStream, load_prompts

    rows_all = load_prompts(str(files[1]))
    seed = next(s for s in range(50)  # a seed whose first draw mixes flat and spread groups
                if 0 < sum(not is_flat(r["prompt"]) for r in PromptStream(rows_all, 4, s).next_batch()) < 4)
    cfg = _cfg(tmp_path, files, difficulty__max_rounds=0, seed=seed, ppo__epochs=1, data__eval_fraction=0.0,
               eval__every=0)  # the stream's rows: all of them
    run = setup(cfg)
    _, drawn = copy.deepcopy(run.data.prompts).draw()
    n_spread = sum(not is_flat(r["prompt"]) for r in drawn)
    rows = _forward_rows(monkeypatch)
    m = ppo_step(run, cfg, 1)
    assert 0 < n_spread < 4
    assert m["filter/groups_kept"] == n_spread and m["filter/groups_short"] == 4 - n_spread
    assert rows["score"] == [n_spread * K, n_spread * K]  # old and reference log-probs
    assert sum(rows["train"]) == n_spread * K and m["ppo/updates"] == -(-n_spread * K // cfg.minibatch_size)


def test_a_step_alone_with_no_group_with_spread_runs_no_forward(files, tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, files, reward="difficulty_rules:always_flat", difficulty__max_rounds=1)
    run = setup(cfg)
    rows = _forward_rows(monkeypatch)
    m = ppo_step(run, cfg, 1)
    assert rows == {"score": [], "train": []}
    assert m["ppo/updates"] == 0 and m["health/dropped_rows"] == 0 and m["group/no_spread_fraction"] == 1.0
    assert m["perf/kept_tokens_per_second"] == 0.0 and m["perf/tokens_per_second"] > 0
