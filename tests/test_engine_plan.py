"""The rollout engine's memory per process in each layout (tether plan / --dry-run, issue 28), by hand for the 7B
preset (Llama-2-7B shapes: L 32, d 4096, 32 heads of 128, V 32000, untied; N = 7e9 nominal), bf16, B 8, S 1024."""

import json

import pytest

from tether.diagnostics.engine_plan import engine_plan
from tether.diagnostics.plan import PlanConfig
from tether.diagnostics.shapes import resolve_shape

GB = 1e9
KV = 2 * 32 * 8 * 1024 * 32 * 128 * 2  # 2·L·B·S·n_kv·d_h·b = 4.29 GB


def rows_by(cfg: PlanConfig) -> dict:
    return {(r["layout"].split(",")[0] + ("" if "transformers" in r["layout"] else " " + r["layout"].split(", ")[1]),
             r["process"]): r for r in engine_plan(resolve_shape(cfg.model), cfg)}


def test_engine_memory_per_process_by_hand():
    """Full fine-tune over 8 ZeRO-3 trainers, vLLM TP=2, 8 rollout processes: a TP engine holds half the bf16
    weights (7e9·2/2 = 7 GB) and, serving two processes' rows with half the heads each, the same KV per process;
    a sync holds two of the largest blocks (embedding + head, 2·32000·4096 params, fp32 trained weights); the
    transformers engine under FSDP2 gathers the whole fp32 policy (28 GB)."""
    cfg = PlanConfig(model="7b", dtype="bf16", batch_size=8, prompt_length=512, response_length=512, zero=3, gpus=8,
                     engine="vllm", engine_tp=2, rollout_processes=8)
    rows = rows_by(cfg)
    block = 2 * 32000 * 4096  # > (7e9 - block) / 32 per transformer block
    assert rows[("colocated", "every process")]["gathered_policy"] == 7e9 * 4
    assert rows[("colocated", "every process")]["kv_cache"] == KV
    vllm = rows[("colocated vLLM TP=2", "every process")]
    assert (vllm["engine_weights"], vllm["kv_cache"], vllm["sync_blocks"]) == (7e9, KV, 2 * block * 4)
    rollout = rows[("disaggregated R=8", "rollout process")]
    assert (rollout["engine_weights"], rollout["kv_cache"], rollout["this_run"]) == (7e9, KV, True)
    assert rows[("disaggregated R=8", "trainer")]["total"] == 2 * block * 4
    assert vllm["vllm_gpu_memory_utilization"] == pytest.approx(((7e9 + KV) * 1.2 + 2**30) / (80 * GB))


def test_engine_memory_lora_and_fewer_rollout_processes():
    """LoRA r 16: the gathered policy is the bf16 base plus fp32 adapters, a sync block is in bf16; 8 trainers on 2
    rollout processes: each samples 4 trainers' rows (4x the KV of one)."""
    cfg = PlanConfig(model="7b", dtype="bf16", batch_size=8, prompt_length=512, response_length=512, zero=3, gpus=8,
                     lora_r=16, lora_targets="attn", engine="vllm", rollout_processes=2)
    rows = rows_by(cfg)
    adapters = 32 * 4 * 16 * (4096 + 4096)  # r·(in + out) per q, k, v, o projection
    assert rows[("colocated", "every process")]["gathered_policy"] == 7e9 * 2 + adapters * 4
    assert rows[("disaggregated R=2", "trainer")]["sync_blocks"] == 2 * (2 * 32000 * 4096) * 2
    assert rows[("disaggregated R=2", "rollout process")]["kv_cache"] == 4 * KV


def test_plan_json_and_text_carry_the_layouts(capsys):
    from tether.cli import main

    assert main(["plan", "--model", "7b", "--gpus", "2", "--zero", "3", "--engine", "vllm", "--json"]) == 0
    engines = json.loads(capsys.readouterr().out)["engines"]
    assert [e["this_run"] for e in engines] == [False, True, False, False]
    assert main(["plan", "--model", "7b", "--rollout-processes", "1"]) == 0
    text = capsys.readouterr().out
    assert "rollout engine per process" in text and "* disaggregated, R=1" in text


def test_dry_run_plans_the_trainers_and_the_layouts(tmp_path, monkeypatch):
    """--dry-run of a 3-process launch with --rollout-processes 1: the trainers' table is for 2 processes, and the
    engine section marks the disaggregated rows as this run's."""
    from tiny import make_policy_dir, make_prompts_file, tiny_config

    from tether.ppo.dryrun import dry_run, run_plan_config

    cfg = tiny_config(tmp_path, make_policy_dir(tmp_path), make_prompts_file(tmp_path),
                      generation__rollout_processes=1)
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert run_plan_config(cfg, 80.0).gpus == 2
    text = dry_run(cfg)
    assert "2 trainer(s)" in text and "* disaggregated, R=1" in text and "rollout process" in text


def test_doctor_names_the_rollout_layout_of_the_share():
    """The rollout share is read with the layout it was measured in (from config.yaml): colocated with its engine
    (and TP), or disaggregated with its rollout processes; none for a run saved before the keys."""
    from test_doctor import SPLIT_TIMES, healthy_rows

    from tether.diagnostics.doctor import diagnose, format_diagnosis

    rows = [{**r, **SPLIT_TIMES} for r in healthy_rows()]
    config = {"steps": len(rows), "generation": {"engine": "vllm", "engine_tp": 1, "rollout_processes": 2}}
    line = format_diagnosis(diagnose(rows, run_config=config)).splitlines()[-1]
    assert "rollout share 25% (disaggregated, 2 rollout processes (vllm); healthy" in line
    config["generation"].update(rollout_processes=0, engine_tp=2)
    assert diagnose(rows, run_config=config).layout == "colocated, vllm TP=2"
    assert diagnose(rows, run_config={"steps": len(rows)}).layout == ""


def test_the_verdict_counts_what_each_layout_holds_in_the_rollout():
    """Issue 41's case, the 7B preset, bf16 full fine-tune with a value head, ZeRO-3 over 8 GPUs, B 8, 512 + 512: the
    rollout phase holds the reference and the RM whole (14 GB each, not 1.75 GB shards) and, with the transformers
    engine, the whole fp32 policy FSDP2 generation gathers (28 GB): 75.29 GB where the plan said 22.79. With vLLM
    colocated the actor's KV is the engine's (its weights, its KV, a sync's two blocks); disaggregated, a trainer
    holds the sync's two blocks and no KV."""
    from tether.diagnostics.plan import kv_cache_bytes, plan

    cfg = PlanConfig(model="7b", dtype="bf16", batch_size=8, prompt_length=512, response_length=512, zero=3, gpus=8,
                     critic="head")
    shape = resolve_shape("7b")
    rollout = plan(shape, cfg)["phases"]["rollout"]
    assert rollout["reference"]["weights"] == rollout["RM"]["weights"] == 14e9
    assert rollout["engine"]["weights"] == 7e9 * 4 and rollout["engine"]["kv_cache"] == 0
    assert rollout["actor"]["kv_cache"] == KV
    actor = 1.75e9 + 7e9 + 3.5e9 + rollout["actor"]["activations"] + KV  # shard + Adam + master + the log-prob pass
    assert rollout["actor"]["total"] == actor
    total = actor + rollout["critic"]["total"] + 14e9 + 14e9 + 28e9
    assert plan(shape, cfg)["totals"]["rollout"] == pytest.approx(total) and total / GB == pytest.approx(75.29, abs=0.01)
    block = 2 * 32000 * 4096 * 4  # the largest unit a sync gathers (embeddings + head), fp32 trained weights
    vllm = plan(shape, PlanConfig(**{**cfg.__dict__, "engine": "vllm", "engine_tp": 2}))["phases"]["rollout"]
    assert vllm["actor"]["kv_cache"] == 0
    assert (vllm["engine"]["weights"], vllm["engine"]["kv_cache"]) == (7e9 + 2 * block, KV)
    split = plan(shape, PlanConfig(**{**cfg.__dict__, "rollout_processes": 8}))["phases"]["rollout"]
    assert (split["actor"]["kv_cache"], split["engine"]["weights"], split["engine"]["kv_cache"]) == (0, 2 * block, 0)
    assert kv_cache_bytes(shape, 8, 1024, 2) == KV
