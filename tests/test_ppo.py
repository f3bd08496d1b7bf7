"""PPO trainer on tiny models: ratio = 1 on the first minibatch, reference = base with the adapter
disabled, masks and bootstrap, frozen advantages, parameter updates, early stop, adaptive KL, resume,
a toy reward that rises."""

import copy
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny import make_policy_dir, make_prompts_file, tiny_config

import tether.ppo.step as ppo_module
from tether.ppo.config import PPOConfig
from tether.ppo.forward import forward_response
from tether.ppo.setup import setup
from tether.ppo.step import ppo_step
from tether.ppo.train import train
from tether.rollout.sampling import response_mask_after_eos


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo")
    return make_policy_dir(root), make_prompts_file(root)


def test_response_mask_after_first_eos():
    eos = 1
    response = torch.tensor([[5, 6, 1, 7, 1], [5, 1, 1, 1, 1], [5, 6, 7, 8, 9], [1, 0, 0, 0, 0]])
    mask, ended = response_mask_after_eos(response, [eos])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert ended.tolist() == [True, True, False, True]


def test_first_minibatch_ratio_is_exactly_one(files, tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, *files, ppo__mini_batches=4)
    c = setup(cfg)
    seen = []
    import tether.ppo.update as update_module

    original = update_module.ppo_policy_loss

    def spy(logprobs, logprobs_old, advantages, mask, clip_range, **kwargs):
        loss, stats = original(logprobs, logprobs_old, advantages, mask, clip_range, **kwargs)
        seen.append(stats)
        return loss, stats

    monkeypatch.setattr(update_module, "ppo_policy_loss", spy)
    ppo_step(c, cfg, 1)
    assert seen[0]["ratio_mean"].item() == 1.0
    assert seen[0]["ratio_max"].item() == 1.0
    assert seen[0]["ratio_std"].item() == 0.0
    assert seen[0]["clip_fraction"].item() == 0.0
    assert any(s["ratio_std"].item() > 0 for s in seen[1:])  # later minibatches see an updated policy


def test_lora_reference_is_the_base_model_with_adapter_disabled(files, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(tmp_path, *files, model__lora_r=4, optim__lr=1e-2)
    c = setup(cfg)
    assert c.models.policy.reference is None  # no second copy in memory
    ppo_step(c, cfg, 1)
    from tether.ppo.step import rollout_batch

    batch, _ = rollout_batch(c.models, cfg, c.data.prompts.next_batch())
    with torch.no_grad():
        with c.models.policy.reference_model(c.models.policy_model) as ref:
            logprobs_ref, _, _ = forward_response(ref, batch, 1.0)
        logprobs_policy, _, _ = forward_response(c.models.policy_model, batch, 1.0)
        base = AutoModelForCausalLM.from_pretrained(files[0]).eval()
        logprobs_base, _, _ = forward_response(base, batch, 1.0)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(logprobs_ref[mask], logprobs_base[mask], rtol=0, atol=1e-5)
    assert (logprobs_policy[mask] - logprobs_base[mask]).abs().max() > 1e-4  # the adapter did learn


def test_truncation_bootstrap_and_frozen_advantages(files, tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, *files, generation__max_new_tokens=3)
    c = setup(cfg)
    captured = {}
    original_gae, original_epochs = ppo_module.gae, ppo_module.ppo_epochs

    def spy_gae(rewards, values, mask, gamma, lam, last_values=None):
        captured["last_values"] = last_values.clone()
        captured["mask"] = mask.clone()
        return original_gae(rewards, values, mask, gamma, lam, last_values)

    def spy_epochs(c_, cfg_, batch, step):
        frozen = {k: getattr(batch, k).clone() for k in ("advantages", "returns", "logprobs_old", "values_old")}
        out = original_epochs(c_, cfg_, batch, step)
        for k, v in frozen.items():
            assert torch.equal(getattr(batch, k), v), f"{k} changed during the epoch loop"
        captured["batch"] = batch
        return out

    monkeypatch.setattr(ppo_module, "gae", spy_gae)
    monkeypatch.setattr(ppo_module, "ppo_epochs", spy_epochs)
    # The models as they were when the step computed its values (the epoch loop then updates them).
    policy, head = copy.deepcopy(c.models.unwrapped_policy), copy.deepcopy(c.models.unwrapped_critic)
    ppo_step(c, cfg, 1)
    batch = captured["batch"]
    rollout = batch.rollout
    truncated = ~rollout.ended_with_eos
    assert truncated.any(), "with 3 new tokens a random policy must truncate some rows"
    # Bootstrap: exactly 0 for rows that ended with EOS; for a truncated row, V(s_T) of the state after its
    # last token, recomputed here on the unpadded sequence by the policy's backbone and the value head.
    assert (captured["last_values"][~truncated] == 0).all()
    with torch.no_grad():
        for i in truncated.nonzero().flatten().tolist():
            ids = torch.cat([rollout.query[i][rollout.query_mask[i].bool()], rollout.response[i]])[None]
            hidden = policy(input_ids=ids, output_hidden_states=True).hidden_states[-1]  # (1, S, H)
            v_last = head(hidden)[0, -1]
            torch.testing.assert_close(captured["last_values"][i], v_last, rtol=0, atol=1e-5)
    assert (batch.advantages[batch.response_mask == 0] == 0).all()


def _trainable_snapshot(c):
    return {n: p.detach().clone() for n, p in c.models.unwrapped_policy.named_parameters()}, \
           {n: p.detach().clone() for n, p in c.models.unwrapped_critic.named_parameters()}


@pytest.mark.parametrize("lora_r", [0, 4])
def test_every_trainable_parameter_changes_and_no_frozen_one(files, tmp_path, lora_r):
    cfg = tiny_config(tmp_path, *files, model__lora_r=lora_r, critic__kind="separate")
    c = setup(cfg)
    policy_before, critic_before = _trainable_snapshot(c)
    ref_before = {n: p.detach().clone() for n, p in c.models.policy.reference.named_parameters()} \
        if c.models.policy.reference is not None else {}
    ppo_step(c, cfg, 1)
    for name, p in c.models.unwrapped_policy.named_parameters():
        changed = not torch.equal(p.detach(), policy_before[name])
        assert changed == p.requires_grad, f"{name}: requires_grad={p.requires_grad} changed={changed}"
    for name, p in c.models.unwrapped_critic.named_parameters():
        assert not torch.equal(p.detach(), critic_before[name]), f"critic {name} did not change"
    for name, p in (c.models.policy.reference.named_parameters() if c.models.policy.reference is not None else []):
        assert torch.equal(p, ref_before[name]), f"reference {name} changed"


def test_lora_critic_trains_only_its_adapter_and_head(files, tmp_path):
    """--critic separate --critic-lora-r 4: the critic's backbone is frozen under an adapter; after a step
    the value head and the adapters' B matrices moved (A gets no gradient while B is still 0), nothing else."""
    cfg = tiny_config(tmp_path, *files, critic__kind="separate", critic__lora_r=4, critic__model=str(files[0]))
    c = setup(cfg)
    critic = c.models.unwrapped_critic
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("head.") for n in trainable)
    assert all(p.dtype == torch.float32 for p in critic.parameters() if p.requires_grad)
    ppo_step(c, cfg, 1)
    changed = {n for n, p in critic.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed <= trainable
    assert {n for n in trainable if n.startswith("head.") or "lora_B" in n} <= changed


def test_critic_warmup_updates_only_the_critic(files, tmp_path):
    cfg = tiny_config(tmp_path, *files, critic__warmup_steps=1)
    c = setup(cfg)
    policy_before, critic_before = _trainable_snapshot(c)
    metrics = ppo_step(c, cfg, 1)
    assert all(torch.equal(p.detach(), policy_before[n]) for n, p in c.models.unwrapped_policy.named_parameters())
    assert any(not torch.equal(p.detach(), critic_before[n]) for n, p in c.models.unwrapped_critic.named_parameters())
    assert "policy/loss" not in metrics and "value/loss" in metrics


def test_kl_early_stop_fires_where_approx_kl_crosses_factor_times_ppo_target_kl(files, tmp_path, monkeypatch):
    """B10: the epoch loop stops after the first epoch whose mean approx KL to π_old (as measured: the mean of its
    minibatches' k3 estimates) exceeds ppo.early_stop_factor × ppo.target_kl; kl.target (the controller's KL to
    the reference) plays no part."""
    import tether.ppo.update as update_module

    measured = []
    original = update_module.ppo_policy_loss

    def spy(*args, **kwargs):
        loss, stats = original(*args, **kwargs)
        measured.append(stats["approx_kl"].item())  # one call per minibatch (no gradient accumulation)
        return loss, stats

    monkeypatch.setattr(update_module, "ppo_policy_loss", spy)

    def step_1(**overrides):
        measured.clear()
        cfg = tiny_config(tmp_path, *files, ppo__epochs=4, **overrides)
        metrics, per = ppo_step(setup(cfg), cfg, 1), cfg.ppo.mini_batches
        return metrics, [sum(measured[i:i + per]) / per for i in range(0, len(measured), per)]

    metrics, _ = step_1(ppo__target_kl=1e-12)
    assert metrics["ppo/epochs_run"] == 1 and metrics["ppo/early_stopped"] == 1.0
    assert step_1(ppo__target_kl=1e-12, ppo__early_stop=False)[0]["ppo/epochs_run"] == 4
    metrics, kls = step_1(kl__target=1e-12, ppo__target_kl=1e3)  # a tiny kl.target alone stops nothing
    assert metrics["ppo/epochs_run"] == 4 and metrics["ppo/early_stopped"] == 0.0
    assert len(kls) == 4 and kls[0] < kls[1] * 0.999 and kls[2] > kls[1] * 1.001, kls  # π leaves π_old epoch by epoch
    factor = PPOConfig().early_stop_factor
    for target, epochs in ((kls[1] / factor * (1 - 1e-4), 2), (kls[1] / factor * (1 + 1e-4), 3)):
        metrics, kls_seen = step_1(ppo__target_kl=target)  # epoch 2's KL just above / just below the threshold
        assert metrics["ppo/epochs_run"] == epochs and kls_seen == kls[:epochs], (target, kls_seen, kls)


def test_adaptive_beta_waits_for_a_rollout_of_the_updated_policy(files, tmp_path):
    """B11 with critic warm-up: steps 1-2 leave the policy frozen and step 3 still samples from it (its first update
    comes after the rollout): their KL to the reference is exactly 0 and says nothing about β, which stays. Step 4
    samples from the updated policy, its KL exceeds the tiny target: β doubles for step 5."""
    cfg = tiny_config(tmp_path, *files, kl__controller="adaptive", kl__target=1e-9, kl__estimator="k3",
                      critic__warmup_steps=2, steps=5, optim__lr=1e-2)
    rows = _rows(train(cfg))
    betas, kls = [r["objective/kl_coef"] for r in rows], [r["objective/kl"] for r in rows]
    assert kls[:3] == [0.0, 0.0, 0.0] and kls[3] > 1.5 * cfg.kl.target, kls
    assert betas == [cfg.kl.coef] * 4 + [2 * cfg.kl.coef], betas


def test_adaptive_controller_raises_beta_when_kl_exceeds_target(files, tmp_path):
    cfg = tiny_config(tmp_path, *files, kl__controller="adaptive", kl__target=1e-9, kl__estimator="k3",
                      steps=3, optim__lr=1e-2)
    run = train(cfg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    betas = [r["objective/kl_coef"] for r in rows]
    kls = [r["objective/kl"] for r in rows]
    assert betas[0] == cfg.kl.coef
    # Step 1 samples from π = π_ref: its KL is exactly 0 and says nothing about β, which stays; afterwards the
    # KL exceeds the tiny target and β doubles at every step.
    assert kls[0] == 0.0 and betas[1] == cfg.kl.coef
    for i in range(1, len(rows) - 1):
        if kls[i] > 1.5 * cfg.kl.target:
            assert betas[i + 1] == pytest.approx(2 * betas[i])
        elif kls[i] < cfg.kl.target / 1.5:
            assert betas[i + 1] == pytest.approx(betas[i] / 2)
    assert any(b2 > b1 for b1, b2 in zip(betas, betas[1:])), betas


def _rows(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def test_resume_equals_uninterrupted_run(files, tmp_path):
    from safetensors.torch import load_file

    straight = tiny_config(tmp_path / "a", *files, steps=4, save_every=2, model__lora_r=4, eval__every=2,
                           eval__n=8, reward__normalize="running", data__eval_fraction=0.25, eval__at_start=True)
    train(straight)
    first = tiny_config(tmp_path / "b", *files, steps=2, save_every=2, model__lora_r=4, eval__every=2,
                        eval__n=8, reward__normalize="running", data__eval_fraction=0.25, eval__at_start=True)
    train(first)
    resumed = copy.deepcopy(first)
    resumed.steps = 4
    train(resumed, resume=True)
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    rows_a, rows_b = _rows(a), _rows(b)
    assert [r["step"] for r in rows_b] == [0, 1, 2, 3, 4]  # the step-0 baseline once, not again on resume
    assert rows_a == rows_b
    wa, wb = load_file(str(a / "policy" / "model.safetensors")), load_file(str(b / "policy" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (a / "samples" / "step_4.jsonl").read_text() == (b / "samples" / "step_4.jsonl").read_text()


def test_eval_at_start_is_the_untrained_policy_evaluated(files, tmp_path):
    from tether.ppo.evaluate import evaluate

    cfg = tiny_config(tmp_path, *files, steps=1, eval__every=1, eval__n=8, eval__at_start=True,
                      data__eval_fraction=0.25)
    run = train(cfg)
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1]
    assert set(rows[0]) == {"step", "eval/reward", "eval/reward_std", "eval/n", "eval/kl_sequence",
                            "eval/distinct_responses", "eval/response_length"}  # _rows leaves perf/ out
    assert rows[0]["eval/kl_sequence"] == 0.0  # nothing trained yet: policy == reference
    fresh, samples = evaluate(setup(cfg), cfg, 0)  # the same initial policy, evaluated on its own
    assert rows[0]["eval/reward"] == pytest.approx(fresh["eval/reward"], abs=1e-6)
    assert len(samples) == 8 and rows[0]["eval/distinct_responses"] == len({s["response"].strip() for s in samples}) / 8
    # the reward by hand from the texts (tiny_config's rule: the share of "7" among the response's characters)
    by_hand = [r.count("7") / len(r) if r else 0.0 for r in (s["response"] for s in samples)]
    assert rows[0]["eval/reward"] == pytest.approx(sum(by_hand) / 8, abs=1e-6)
    assert rows[0]["eval/response_length"] == pytest.approx(sum(s["length"] for s in samples) / 8)
    assert (run / "samples" / "step_0.jsonl").is_file() and (run / "samples" / "step_1.jsonl").is_file()
    # step 1 against the step-0 answers (the reference policy's): overlap and reward gain by hand from the files
    from tether.diagnostics.text import word_f1

    before, after = ([json.loads(line) for line in (run / "samples" / f"step_{s}.jsonl").read_text().splitlines()]
                     for s in (0, 1))
    assert [s["reference"] for s in after] == [s["response"] for s in before]
    overlap = sum(word_f1(a["response"], b["response"]) for a, b in zip(after, before)) / 8
    assert rows[1]["eval/reference_overlap"] == pytest.approx(overlap)
    assert rows[1]["eval/reward_gain"] == pytest.approx(rows[1]["eval/reward"] - rows[0]["eval/reward"])


def test_distinct_responses_by_hand():
    from tether.ppo.evaluate import distinct_fraction

    assert distinct_fraction(["The answer is 2."] * 100) == 0.01
    assert distinct_fraction(["4", " 4\n", "5", "x"]) == 0.75  # surrounding whitespace is not a difference
    assert distinct_fraction(["a", "b"]) == 1.0 and math.isnan(distinct_fraction([]))


def test_toy_reward_rises_with_kl_tether(files, tmp_path):
    cfg = tiny_config(tmp_path, *files, steps=20, batch_size=16, ppo__mini_batches=2, optim__lr=3e-3,
                      kl__coef=0.05, generation__max_new_tokens=8, reward__sources=["tether.rules:char_share:char=7"])
    run = train(cfg)
    rows = _rows(run)
    early = sum(r["objective/scores_raw"] for r in rows[:4]) / 4
    late = sum(r["objective/scores_raw"] for r in rows[-4:]) / 4
    assert late > early + 0.1, (early, late)
    assert max(r["objective/kl"] for r in rows) < 2.0  # bounded per-token KL to the reference


def test_reward_model_source_and_separate_critic_from_it(files, tmp_path):
    """PPO against a tether reward model (the RM scores decoded text with its own tokenizer); the
    separate critic starts from the RM backbone, which shares the policy's tokenizer."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from tether.demo.task import build_tokenizer
    from tether.rm.model import RewardModel, choose_format

    tokenizer = build_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_layer=1, n_embd=16, n_head=2, num_labels=1,
                        pad_token_id=tokenizer.pad_token_id, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    torch.manual_seed(0)
    rm = RewardModel(GPT2ForSequenceClassification(config), tokenizer, choose_format(tokenizer, "plain"))
    rm.set_normalization(torch.tensor([0.5, 1.5]))
    rm_dir = tmp_path / "rm"
    rm.save_pretrained(rm_dir)
    cfg = tiny_config(tmp_path, *files, reward__sources=[str(rm_dir)], critic__kind="separate", steps=1)
    c = setup(cfg)
    assert c.models.unwrapped_critic.backbone.config.n_embd == 16  # initialised from the RM, not the policy
    from tether.ppo.prompts import collate_fields
    from tether.ppo.sources import score_responses
    from tether.ppo.step import rollout_batch

    rows = c.data.prompts.next_batch()
    _, responses = rollout_batch(c.models, cfg, rows)
    prompts = [r["prompt"] for r in rows]
    # Independently: HF's own sequence-classification forward on each plain text, one at a time (its own
    # last-token pooling, no padding), standardised with the stored mean 1.0 and std 0.5.
    model = RewardModel.from_pretrained(rm_dir, device="cpu").model
    with torch.no_grad():
        raw = [model(input_ids=torch.tensor([tokenizer(p + r)["input_ids"]])).logits[0, 0] for p, r in
               zip(prompts, responses)]
    expected = (torch.stack(raw) - 1.0) / 0.5
    torch.testing.assert_close(score_responses(c.data.sources, prompts, responses, collate_fields(rows)), expected,
                               atol=1e-5, rtol=1e-5)
    metrics = ppo_step(c, cfg, 1)
    assert torch.isfinite(torch.tensor(metrics["objective/scores"]))


def test_training_side_logprobs_match_the_sampler_under_left_padding(files):
    """The training-side forward (positions from the attention mask, logits / T) scores each sampled
    token exactly as the sampler's own logits did, for left-padded prompts of different lengths."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from tether.hf import load_tokenizer
    from tether.rollout.records import Rollout
    from tether.rollout.sampling import encode_prompts, response_mask_after_eos

    tokenizer = load_tokenizer(files[0])
    model = AutoModelForCausalLM.from_pretrained(files[0]).eval()
    query, query_mask = encode_prompts(tokenizer, ["1+2=", "123+456=", "9="], 16, False)
    assert (query_mask == 0).any()  # really left-padded
    temperature = 0.7
    torch.manual_seed(0)
    out = model.generate(input_ids=query, attention_mask=query_mask, return_dict_in_generate=True,
                         output_logits=True, generation_config=GenerationConfig(
                             do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=6,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    response = out.sequences[:, query.shape[1]:]
    sampler_logits = torch.stack(out.logits, dim=1) / temperature  # (B, T, V) raw logits at each step
    sampler_logprobs = torch.log_softmax(sampler_logits, -1).gather(-1, response[..., None])[..., 0]
    mask, ended = response_mask_after_eos(response, [tokenizer.eos_token_id])
    batch = Rollout(query, query_mask, response, mask, ended)
    with torch.no_grad():
        logprobs, _, _ = forward_response(model, batch, temperature)
    torch.testing.assert_close(logprobs[mask.bool()], sampler_logprobs[mask.bool()], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ gradient accumulation
WORKER = Path(__file__).resolve().parent / "ppo_invariance_worker.py"


def _worker_grads(files, out: Path, accumulation: int, processes: int = 1, config: str = "",
                  trim: bool = True) -> dict:
    worker = [str(WORKER), str(files[0]), str(files[1]), str(out), str(accumulation), str(trim).lower()]
    if processes > 1:  # tests/launcher.py: a free port; a failure raises with each process's own stderr
        from launcher import accelerate_launch

        accelerate_launch(worker, config=config or None, processes=processes)
        return torch.load(out, weights_only=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, *worker], capture_output=True, text=True, timeout=600, env=env,
                          cwd=WORKER.parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


def _assert_same_gradients(a: dict, b: dict) -> None:
    assert torch.equal(a["lengths"], b["lengths"]) and len(set(a["lengths"].tolist())) > 1
    assert len(a["grads"]) == len(b["grads"]) == 2  # policy, then critic, one optimiser step each
    for grads_a, grads_b in zip(a["grads"], b["grads"]):
        assert any(g.abs().max() > 0 for g in grads_a)
        for g_a, g_b in zip(grads_a, grads_b):
            torch.testing.assert_close(g_a, g_b, rtol=1e-4, atol=1e-7)


def test_one_microbatch_of_8_equals_8_microbatches_of_1(files, tmp_path):
    """Same 8 rollouts of different lengths: the gradient at the optimiser step is the same whether the
    minibatch is one micro-batch or 8 accumulated ones (the loss is a token mean over the minibatch)."""
    _assert_same_gradients(_worker_grads(files, tmp_path / "a1.pt", 1), _worker_grads(files, tmp_path / "a8.pt", 8))


@pytest.mark.slow
def test_two_processes_of_4_equal_one_process_of_8(files, tmp_path):
    """The same 8 rollouts split 4 + 4 over two DDP processes (gloo) give the one-process gradient, although
    the two halves hold different token counts (DDP's plain average over processes would not)."""
    _assert_same_gradients(_worker_grads(files, tmp_path / "one.pt", 1),
                           _worker_grads(files, tmp_path / "two.pt", 2, processes=2))


def test_step_reports_flops_mfu_and_padding(files, tmp_path):
    """perf/tflops_step is the model FLOPs of the step's phases (tether.core.flops, checked against torch's
    count in test_flops) and perf/mfu their rate over the device peak; padding_fraction from the batch shape."""
    cfg = tiny_config(tmp_path, *files, ppo__epochs=2, ppo__early_stop=False)
    c = setup(cfg)
    metrics = ppo_step(c, cfg, 1)
    assert 0 < metrics["perf/mfu"] < 1 and 0 < metrics["perf/mfu_train"] < 1
    assert 0 <= metrics["perf/padding_fraction"] < 1
    rate = metrics["perf/tflops_step"] * 1e12 / metrics["perf/seconds_step"]
    assert metrics["perf/mfu"] == pytest.approx(rate / c.perf.peak)


def test_trimmed_length_grouped_microbatches_give_the_padded_gradient(files, tmp_path):
    """ppo.trim_padding sorts a minibatch's rows by length into micro-batches and cuts each micro-batch's
    all-padding columns: the gradient is the one of the padded, unsorted micro-batches."""
    _assert_same_gradients(_worker_grads(files, tmp_path / "padded.pt", 4, trim=False),
                           _worker_grads(files, tmp_path / "trimmed.pt", 4, trim=True))


def test_trimmed_cuts_only_columns_that_are_padding_in_every_row():
    from tether.ppo.records import Experience
    from tether.rollout.records import Rollout

    query_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])  # the first column is padding in both rows
    response_mask = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])  # the last 3 columns too
    rollout = Rollout(query=torch.arange(8).view(2, 4), query_mask=query_mask, response=torch.arange(10).view(2, 5),
                      response_mask=response_mask, ended_with_eos=torch.tensor([True, False]), eos_ids=(3,),
                      min_new_tokens=2)
    per_token = torch.arange(10.0).view(2, 5) * response_mask
    experience = Experience(rollout, *(per_token,) * 3, torch.tensor([0.0, 1.5]), torch.tensor([1.0, 2.0]),
                            *(per_token,) * 4)
    t = experience.trimmed()
    assert torch.equal(t.rollout.query, torch.tensor([[1, 2, 3], [5, 6, 7]]))
    assert torch.equal(t.rollout.query_mask, query_mask[:, 1:]) and torch.equal(t.response_mask, response_mask[:, :2])
    assert torch.equal(t.advantages, per_token[:, :2]) and torch.equal(t.last_values, experience.last_values)
    assert t.rollout.lengths.tolist() == [2, 1] and torch.equal(t.rollout.ended_with_eos, rollout.ended_with_eos)
    assert (t.rollout.eos_ids, t.rollout.min_new_tokens) == ((3,), 2)  # how the rows were sampled travels along
    sampled = replace(rollout, logprobs_sampler=-per_token).trimmed()  # an engine's own log-probs are cut alike
    assert torch.equal(sampled.logprobs_sampler, -per_token[:, :2])


@pytest.mark.slow
def test_two_fsdp2_processes_of_4_equal_one_process_of_8(files, tmp_path):
    """The same under FSDP2 (examples/accelerate/fsdp2.yaml): policy and critic sharded over the two processes,
    micro-batch gradients accumulated without sync, reduce-scattered at the last; the whole gradients at the
    optimiser step equal the one-process ones."""
    _assert_same_gradients(_worker_grads(files, tmp_path / "one.pt", 1),
                           _worker_grads(files, tmp_path / "fsdp.pt", 2, processes=2, config="fsdp2.yaml"))


def test_fused_adamw_takes_the_same_step_up_to_rounding(files, tmp_path):
    """--fused-adamw: both optimisers use torch's fused kernel, and one PPO step from one seed lands where the
    default (foreach) kernel lands, up to float rounding (the two round differently: not bitwise)."""
    weights = {}
    for fused in (False, True):
        cfg = tiny_config(tmp_path / str(fused), *files, critic__kind="separate", optim__fused_adamw=fused)
        c = setup(cfg)
        assert bool(c.optim.policy_optimizer.defaults["fused"]) is fused
        assert bool(c.optim.critic_optimizer.defaults["fused"]) is fused
        before, _ = _trainable_snapshot(c)
        ppo_step(c, cfg, 1)
        weights[fused] = _trainable_snapshot(c)
    for name, p in weights[False][0].items():
        assert not torch.equal(p, before[name])
        torch.testing.assert_close(weights[True][0][name], p, rtol=0, atol=1e-5, msg=name)
    for name, p in weights[False][1].items():
        torch.testing.assert_close(weights[True][1][name], p, rtol=0, atol=1e-5, msg=name)
