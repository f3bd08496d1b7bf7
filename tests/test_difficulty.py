"""Difficulty-aware sampling (SPEC B18): dynamic sampling drops exactly the groups with no spread and draws more
prompts, up to a bound (then a metric and one warning line); the prompt curriculum's weights by hand, its memory
resumed exactly; two processes each fill their own share."""

import copy
import json

import pytest
import torch
from difficulty_rules import K, filter_cfg, is_flat
from launcher import accelerate_launch
from tiny import make_policy_dir, make_prompts_file

from tether.ppo.curriculum import Curriculum
from tether.ppo.draw import draw_step_batch
from tether.ppo.perf import PhaseTimer
from tether.ppo.setup import setup
from tether.ppo.step import ppo_step, sample_batch
from tether.ppo.train import train


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("difficulty")
    return make_policy_dir(root), make_prompts_file(root, n=40)


_cfg = filter_cfg


def test_flat_groups_are_dropped_and_replaced_by_the_next_draws(files, tmp_path):
    cfg = _cfg(tmp_path, files, difficulty__max_rounds=20)
    run = setup(cfg)
    replay = copy.deepcopy(run.data.prompts)  # the stream as the step will draw from it
    batch = draw_step_batch(run, cfg, PhaseTimer(), lambda: sample_batch(run, cfg, 1, PhaseTimer()))
    # by hand: draw rounds of 4 prompts until 4 non-flat ones are found, in draw order
    expected, drawn = [], 0
    while len(expected) < 4:
        _, rows = replay.draw()
        drawn += 4
        expected += [r["prompt"] for r in rows if not is_flat(r["prompt"])]
    assert [r["prompt"] for r in batch.rows[::K]] == expected[:4]
    assert all(batch.rows[g * K + i]["prompt"] == expected[g] for g in range(4) for i in range(K))
    assert batch.kept.all()
    assert batch.metrics["filter/prompts_drawn"] == drawn and batch.metrics["filter/groups_kept"] == 4
    assert batch.metrics["filter/rounds"] == drawn // 4 - 1 and batch.metrics["filter/groups_short"] == 0
    assert torch.equal(batch.rewards_raw.total, torch.tensor([0.0, 1.0, 2.0, 3.0] * 4))
    assert len(batch.drawn_scores) == drawn * K  # every drawn group, for group/no_spread_fraction
    assert batch.rollout.query.shape[0] == 16 and batch.rollout.response.shape[0] == 16


def test_the_bound_reached_trains_on_what_it_has_and_says_so(files, tmp_path):
    cfg = _cfg(tmp_path, files, reward="difficulty_rules:always_flat", difficulty__max_rounds=2)
    run = setup(cfg)
    metrics = ppo_step(run, cfg, 1)
    assert metrics["filter/rounds"] == 2 and metrics["filter/prompts_drawn"] == 12
    assert metrics["filter/groups_kept"] == 0 and metrics["filter/groups_short"] == 4
    assert metrics["group/no_spread_fraction"] == 1.0  # the groups as drawn, all flat
    assert metrics["ppo/updates"] == 0 and metrics["health/dropped_rows"] == 0  # filler rows are not "dropped"
    notes = metrics["health/notes"]
    assert len(notes) == 1 and "4 of 4 groups with spread missing after 2 extra rounds" in notes[0]
    # nothing kept, nothing measured over kept rows: no score, KL or entropy of 0 (recipe 4's last steps, every
    # group solved, logged objective/scores 0.0 and policy/entropy 0.0), and the KL controller learns nothing
    for key in ("objective/scores", "objective/kl", "objective/kl_p99", "policy/entropy"):
        assert key not in metrics, key
    assert metrics["objective/kl_coef"] == cfg.kl.coef


def test_a_step_that_kept_nothing_leaves_the_adaptive_kl_controller_alone(files, tmp_path):
    cfg = _cfg(tmp_path, files, reward="difficulty_rules:always_flat", difficulty__max_rounds=0,
               kl__controller="adaptive", kl__target=0.1)
    run = setup(cfg)
    beta = run.optim.kl_controller.value
    for step in (1, 2, 3):
        assert ppo_step(run, cfg, step)["filter/groups_kept"] == 0
    assert run.optim.kl_controller.value == beta  # an adaptive controller fed KL 0 would have lowered it
    cfg.steps, cfg.output_dir = 2, str(tmp_path / "run")
    rows = [json.loads(line) for line in (train(cfg) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0]  # the held-out evaluation at step 0 has no step metrics
    assert [r["filter/groups_kept"] for r in rows] == [0, 0] and not any("objective/scores" in r for r in rows)


def test_short_batch_of_one_process_holds_only_the_groups_with_spread(files, tmp_path):
    """One process alone drops the flat filler groups (no forward over rows of weight 0); the shortfall is counted."""
    from tether.ppo.prompts import PromptStream, load_prompts

    rows_all = load_prompts(str(files[1]))
    seed = next(s for s in range(50)  # a seed whose first draw mixes flat and spread groups
                if 0 < sum(not is_flat(r["prompt"]) for r in PromptStream(rows_all, 4, s).next_batch()) < 4)
    cfg = _cfg(tmp_path, files, difficulty__max_rounds=0, seed=seed)
    run = setup(cfg)
    _, rows = copy.deepcopy(run.data.prompts).draw()
    spread = [r["prompt"] for r in rows if not is_flat(r["prompt"])]
    batch = draw_step_batch(run, cfg, PhaseTimer(), lambda: sample_batch(run, cfg, 1, PhaseTimer()))
    assert [r["prompt"] for r in batch.rows[::K]] == spread
    assert batch.kept.tolist() == [True] * (len(spread) * K)
    assert batch.metrics["filter/groups_short"] == 4 - len(spread)


def test_curriculum_weights_and_pass_rates_by_hand():
    c = Curriculum(n_prompts=5, memory=2, min_weight=0.25, pass_threshold=0.5)
    rates = c.pass_rates(torch.tensor([1.0, 1.0, 0.0, 1.0, float("nan"), 0.0, 0.0, 0.0]), k=4)
    assert rates.tolist() == [0.75, 0.0]  # NaN is not a pass
    c.record([0, 1, 2], [1.0, 0.0, 0.5])
    assert c.weights().tolist() == [1.0] * 5  # one visit remembered of two: not yet judged
    c.record([0, 1, 2, 3], [1.0, 0.0, 1.0, 0.0])
    assert c.weights().tolist() == [0.25, 0.25, 1.0, 1.0, 1.0]  # 0: solved twice, 1: failed twice
    c.record([0], [0.5])
    assert c.visits[0] == [1.0, 0.5] and c.weights()[0] == 1.0  # the oldest visit forgotten
    assert c.summary() == {"curriculum/solved_prompts": 0.0, "curriculum/unsolved_prompts": 0.2,
                           "curriculum/visited_prompts": 0.8}


def test_curriculum_draws_follow_the_weights():
    c = Curriculum(n_prompts=4, memory=1, min_weight=0.1)
    c.record([0, 1], [1.0, 0.0])
    counts = torch.zeros(4)
    for s in range(4000):
        counts[c.draw(1, seed=s)] += 1
    # P(index) = w / Σw with w = (0.1, 0.1, 1, 1): 0.0476, 0.0476, 0.476, 0.476
    torch.testing.assert_close(counts / 4000, torch.tensor([0.1, 0.1, 1.0, 1.0]) / 2.2, atol=0.02, rtol=0)
    assert sorted(c.draw(4, seed=0)) == [0, 1, 2, 3]  # never excluded


def test_curriculum_memory_resumes_exactly(files, tmp_path):
    from safetensors.torch import load_file

    settings = dict(steps=4, save_every=2, difficulty__curriculum=True, difficulty__memory=1)
    straight = train(_cfg(tmp_path / "a", files, **settings))
    first = _cfg(tmp_path / "b", files, **{**settings, "steps": 2})
    train(first)
    state = torch.load(tmp_path / "b" / "run" / "checkpoints" / "step_000002" / "trainer_state.pt",
                       weights_only=False)
    visits = state["prompts"]["curriculum"]["visits"]
    assert visits and all(len(v) == 1 for v in visits.values())  # memory 1: one visit each
    resumed = copy.deepcopy(first)
    resumed.steps = 4
    resumed_dir = train(resumed, resume=True)

    def rows(run):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
                for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert rows(straight) == rows(resumed_dir)
    assert "curriculum/visited_prompts" in rows(straight)[-1]
    wa = load_file(str(straight / "policy" / "model.safetensors"))
    wb = load_file(str(resumed_dir / "policy" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_two_processes_each_fill_their_own_share(files, tmp_path):
    """2 gloo processes, --filter-groups with a curriculum: every step trains on 4 groups with spread per process
    (the rounds run until both are full), and the curriculum's table, gathered from both, is the same on each."""
    policy, prompts = files
    out = tmp_path / "run"
    accelerate_launch(["-m", "tether", "ppo", "--policy", str(policy), "--prompts", str(prompts), "--reward",
                       "difficulty_rules:flat_for_even", "--output-dir", str(out), "--steps", "2", "--batch-size",
                       "4", "--mini-batches", "2", "--max-new-tokens", "4", "--progress", "false",
                       "--save-every", "2", "--advantage", "grpo", "--samples-per-prompt", str(K),
                       "--filter-groups", "true", "--curriculum", "true"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0]  # the held-out evaluation at step 0 has no step metrics
    assert len(rows) == 2 and all(r["filter/groups_kept"] == 8 and r["filter/groups_short"] == 0 for r in rows)
    assert all(r["filter/prompts_drawn"] >= 8 for r in rows)
    state = torch.load(out / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)
    assert len(state["prompts"]["curriculum"]["visits"]) >= 8  # both processes' prompts in one table


def test_shuffled_rewards_keep_their_values_and_move_them_between_rows():
    from tether.ppo.draw import shuffled
    from tether.ppo.sources import RewardScores

    torch.manual_seed(0)
    raw = RewardScores(sequence=torch.arange(8.0), dense=torch.zeros(8, 3), errors={2: "rule raised"})
    out = shuffled(raw)
    assert sorted(out.sequence.tolist()) == list(range(8)) and not torch.equal(out.sequence, raw.sequence)
    moved = out.sequence.tolist().index(2.0)
    assert out.errors == {moved: "rule raised"}  # the failed row's note goes where its score went
