"""Dynamic sampling in one oversampled round (#53 item 1): the first round's size by hand, the rule that keeps groups
unchanged (the first --batch-size groups with spread in draw order), fewer rounds than fixed rounds of --batch-size
at the same seed, the running flat share resumed with the prompt stream, and the refused fractions."""

import math

import pytest
import torch
from difficulty_rules import K, filter_cfg, is_flat
from tiny import make_policy_dir, make_prompts_file

from tether.errors import ConfigError
from tether.ppo.draw import draw_step_batch, prompts_to_draw
from tether.ppo.perf import PhaseTimer
from tether.ppo.prompts import PromptStream
from tether.ppo.setup import setup
from tether.ppo.step import ppo_step, sample_batch


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("oversample")
    return make_policy_dir(root), make_prompts_file(root, n=40)


def test_prompts_to_draw_by_hand():
    """n(1-f) - 1.5 sqrt(n f (1-f)) >= needed: f = 0.5, needed 4 -> 13 gives 3.796, 14 gives 4.194, so 14.
    No flat groups: exactly what is needed. Capped."""
    assert 13 * 0.5 - 1.5 * math.sqrt(13 * 0.25) < 4 <= 14 * 0.5 - 1.5 * math.sqrt(14 * 0.25)
    assert prompts_to_draw(4, 0.5, cap=100) == 14
    assert prompts_to_draw(4, 0.0, cap=100) == 4
    assert prompts_to_draw(4, 0.95, cap=8) == 8
    assert prompts_to_draw(4, 0.5, cap=10) == 10


def _recording(run, cfg, step, rounds):
    def sample(n=None):
        batch = sample_batch(run, cfg, step, PhaseTimer(), n)
        rounds.append(batch)
        return batch
    return sample


def test_first_round_is_sized_from_the_last_steps_flat_share_and_keeps_the_same_groups(files, tmp_path):
    """Step 1 draws --batch-size (nothing known); its flat share (half the prompts start with an even digit, flat
    under flat_for_even), counted here from the prompts themselves, sizes step 2's first round; step 2 keeps the
    first 4 groups with spread in draw order, as fixed rounds would."""
    cfg = filter_cfg(tmp_path, files, difficulty__oversample=0.0, difficulty__max_rounds=4)
    run = setup(cfg)
    rounds1: list = []
    draw_step_batch(run, cfg, PhaseTimer(), _recording(run, cfg, 1, rounds1))
    drawn1 = [r["prompt"] for b in rounds1 for r in b.rows[::K]]
    assert len(rounds1[0].rows) == cfg.batch_size * K
    share1 = sum(map(is_flat, drawn1)) / len(drawn1)
    assert run.data.prompts.flat_share == pytest.approx(share1)

    rounds2: list = []
    out = draw_step_batch(run, cfg, PhaseTimer(), _recording(run, cfg, 2, rounds2))
    expected_first = prompts_to_draw(4, share1, cap=4 * 5)
    assert len(rounds2[0].rows) == expected_first * K
    assert out.metrics["filter/first_round_prompts"] == expected_first
    drawn2 = [r["prompt"] for b in rounds2 for r in b.rows[::K]]
    assert len(set(drawn2)) == len(drawn2)  # no prompt twice in one step
    with_spread = [p for p in drawn2 if not is_flat(p)][:cfg.batch_size]
    assert [r["prompt"] for r in out.rows[::K]] == with_spread
    assert bool(out.kept.all())
    share2 = sum(map(is_flat, drawn2)) / len(drawn2)
    assert out.metrics["filter/flat_share"] == pytest.approx(share2)
    assert run.data.prompts.flat_share == pytest.approx(0.5 * share1 + 0.5 * share2)


def test_sized_rounds_take_fewer_rounds_than_fixed_ones(files, tmp_path):
    """Five steps at the same seed (most of the tiny prompts file's prompts are flat here): fixed rounds of
    --batch-size (oversample 1) against the sized first round. From step 2 the sized one takes fewer extra rounds
    and keeps at least as many groups with spread."""
    extra, kept = {}, {}
    for oversample in (1.0, 0.0):
        cfg = filter_cfg(tmp_path / str(oversample), files, difficulty__oversample=oversample, steps=5, save_every=0)
        run = setup(cfg)
        metrics = [ppo_step(run, cfg, step) for step in range(1, 6)][1:]
        extra[oversample] = sum(m["filter/rounds"] for m in metrics)
        kept[oversample] = sum(m["filter/groups_kept"] for m in metrics)
    assert extra[1.0] >= 3 and extra[0.0] < extra[1.0], extra
    assert kept[0.0] >= kept[1.0], kept


def test_flat_share_is_state_of_the_prompt_stream():
    stream = PromptStream(rows=[{"prompt": str(i)} for i in range(8)], batch_size=2, seed=0)
    stream.flat_share = 0.375
    fresh = PromptStream(rows=stream.rows, batch_size=2, seed=0)
    fresh.load_state_dict(stream.state_dict())
    assert fresh.flat_share == 0.375
    assert len(fresh.next_batch(5)) == 5 and len(fresh.next_batch()) == 2


def test_oversample_between_zero_and_one_is_refused(files, tmp_path):
    with pytest.raises(ConfigError, match=r"--filter-oversample"):
        filter_cfg(tmp_path, files, difficulty__oversample=0.5).validate()


def test_fixed_multiple_draws_that_many(files, tmp_path):
    cfg = filter_cfg(tmp_path, files, difficulty__oversample=2.5)
    run = setup(cfg)
    rounds: list = []
    out = draw_step_batch(run, cfg, PhaseTimer(), _recording(run, cfg, 1, rounds))
    assert len(rounds[0].rows) == math.ceil(2.5 * cfg.batch_size) * K == len(out.drawn_scores[:len(rounds[0].rows)])
    assert out.metrics["filter/first_round_prompts"] == 10 and torch.isfinite(out.drawn_scores).all()
