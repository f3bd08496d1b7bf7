"""Stale shared memory of vLLM's CPU tensor-parallel groups (tether.rollout.vllm_shm): a segment of vLLM's naming that
no live process maps is removed; one a live process maps, or of another naming, is kept; each run names its segments
with its own token (two runs starting together on one machine do not collide). Runs without vLLM."""

import mmap
import subprocess
import sys

import pytest

from tether.rollout.vllm_shm import SEGMENT, mapped_paths, name_segments_after_run, remove_stale_segments


def test_vllm_segment_names_are_recognised():
    for name in ("-tp:0-[0-1]-cpushm_0", "-tp:1-[2-3]-cpushm_1", "abc-pp:0-[0-1-2-3]-cpushm_12"):
        assert SEGMENT.fullmatch(name), name
    for name in ("-tp:0-[0-1]-cpushm", "torch_1234_0", "psm_5f2a", "-tp:0-[0-1]-cpushm_0.lock"):
        assert not SEGMENT.fullmatch(name), name


def test_only_unmapped_segments_are_removed(tmp_path):
    stale, live, other = (tmp_path / n for n in ("-tp:0-[0-1]-cpushm_0", "-tp:0-[0-1]-cpushm_1", "psm_5f2a"))
    for path in (stale, live, other):
        path.write_bytes(b"\0" * 4096)
    # another live process maps one of them, as a starting engine's process does from creation to unlink
    holder = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys; f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 4096); "
        "print('mapped', flush=True); sys.stdin.read()"), str(live)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        assert str(live) in mapped_paths()
        assert remove_stale_segments(tmp_path) == [stale.name]
        assert not stale.exists() and live.exists() and other.exists()
    finally:
        holder.communicate("")
    assert remove_stale_segments(tmp_path) == [live.name]  # its process has ended
    assert other.exists()


def test_a_mapping_of_this_process_counts(tmp_path):
    path = tmp_path / "-tp:0-[0-1]-cpushm_0"
    path.write_bytes(b"\0" * 4096)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 4096):
        assert remove_stale_segments(tmp_path) == [] and path.exists()
    assert remove_stale_segments(tmp_path) == [path.name] and not path.exists()


class FakeSHM:
    """vLLM 0.32's name maker under external_launcher: its ident, "//" (from env://), the group, its ranks."""

    @staticmethod
    def make_group_name(communicator) -> str:
        return f"//-{communicator}-[0-1]-cpushm"


def test_each_run_names_its_segments_with_its_own_token():
    name_segments_after_run("aa11", FakeSHM)
    first = FakeSHM.make_group_name("tp:0")
    assert first == "tetheraa11-tp:0-[0-1]-cpushm"
    assert FakeSHM().make_group_name("tp:0") == first  # called on an instance, as vLLM's __init__ does
    name_segments_after_run("bb22", FakeSHM)  # another run (or engine) in this process: replaced, not nested
    assert FakeSHM.make_group_name("tp:0") == "tetherbb22-tp:0-[0-1]-cpushm"
    assert SEGMENT.fullmatch(first + "_0") and "/" not in first  # still swept when stale; a plain shm name


def test_vllms_own_name_maker_takes_the_token(monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    communicator = type("Communicator", (), {"unique_name": "tp:0", "ranks": [0, 1]})()
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")  # what vLLM's CPU worker sets under external_launcher
    vllms = _CPUSHMDistributed.__dict__["make_group_name"]
    try:
        assert _CPUSHMDistributed.make_group_name(communicator) == "//-tp:0-[0-1]-cpushm"  # every run's name
        name_segments_after_run("cc33")
        assert _CPUSHMDistributed.make_group_name(communicator) == "tethercc33-tp:0-[0-1]-cpushm"
    finally:
        _CPUSHMDistributed.make_group_name = vllms
        if "_vllm_make_group_name" in vars(_CPUSHMDistributed):
            del _CPUSHMDistributed._vllm_make_group_name

