"""Crash safety end to end (B14): a tiny `tether ppo` run SIGKILLed three times at random moments (set by its
progress) and resumed each time ends bitwise equal to a straight run. `bench/soak.py --kills 20` does more."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "soak.py"


@pytest.mark.slow
def test_sigkilled_and_resumed_run_equals_the_straight_run(tmp_path):
    spec = importlib.util.spec_from_file_location("soak", BENCH)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    result = soak.soak(kills=3, steps=6, seed=0, workdir=tmp_path)
    assert result["kills_made"] >= 1, result  # the first launch is killed once its first row is written
    assert result["exact"], result
