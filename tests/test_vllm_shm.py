"""Stale shared memory of vLLM's CPU tensor-parallel groups (tether.rollout.vllm_shm): a segment of vLLM's naming that
no live process maps is removed; one a live process maps, or of another naming, is kept. Runs without vLLM."""

import mmap
import subprocess
import sys

from tether.rollout.vllm_shm import SEGMENT, mapped_paths, remove_stale_segments


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
