"""Mixed precision in PPO (SPEC C5): bf16/fp16 compute under autocast with fp32 masters for everything that
trains; the reference computes exactly as the policy, so before any update the ratio is exactly 1 and the
KL exactly 0 on every token; fp16 trains through a loss scaler whose skipped steps leave no trace. fp32 runs
are covered, unchanged, by tests/test_ppo.py."""

import copy

import pytest
import torch
from tiny import make_policy_dir, make_prompts_file, tiny_config

import tether.ppo.step as ppo_module
from tether.ppo.forward import forward_response
from tether.ppo.setup import setup
from tether.ppo.step import ppo_step


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo_precision")
    return make_policy_dir(root), make_prompts_file(root)


def spy(monkeypatch, name: str, seen: list):
    """Record the arguments and result of ``tether.ppo.step.<name>`` (or ``tether.ppo.update.<name>``, the epoch
    loop's) on every call."""
    import tether.ppo.update as update_module

    module = ppo_module if hasattr(ppo_module, name) else update_module
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append((args, out))
        return out

    monkeypatch.setattr(module, name, wrapper)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_bf16_first_minibatch_ratio_one_and_kl_zero_exactly_with_fp32_masters(files, tmp_path, monkeypatch, lora):
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    extra = {"model__lora_r": 4} if lora else {"critic__kind": "separate", "critic__model": str(files[0])}
    cfg = tiny_config(tmp_path, *files, model__dtype="bf16", ppo__mini_batches=4, **extra)
    run = setup(cfg)
    m = run.models
    checkpoint_bf16 = AutoModelForCausalLM.from_pretrained(files[0], dtype=torch.bfloat16).state_dict()

    # After setup: what trains is fp32 (the masters start at the bf16 checkpoint's values); the reference is bf16.
    trainable = run.optim.policy_params + run.optim.critic_params
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    if lora:
        assert all("lora_" in n for n, p in m.policy_model.named_parameters() if p.requires_grad)
        assert all(p.dtype == torch.bfloat16 for n, p in m.policy_model.named_parameters() if not p.requires_grad)
    else:
        policy_state = m.policy_model.state_dict()
        assert all(torch.equal(policy_state[k], v.float()) for k, v in checkpoint_bf16.items())
        ref = m.policy.reference
        matmuls = [mod for mod in ref.modules() if isinstance(mod, (torch.nn.Linear, Conv1D))]
        tied_head = ref.lm_head.weight is ref.transformer.wte.weight  # the tiny GPT-2 ties it: looked up, fp32
        assert tied_head and ref.transformer.wte.weight.dtype == torch.float32
        assert all(p.dtype == torch.bfloat16 for mod in matmuls if mod is not ref.lm_head
                   for p in mod.parameters(recurse=False))
        assert not any(p.requires_grad for p in ref.parameters())
        assert all(torch.equal(ref.state_dict()[k].float(), v.float()) for k, v in checkpoint_bf16.items())
    reference_before = copy.deepcopy(m.policy.reference.state_dict()) if not lora else None

    generated_under, rollouts, losses, kls = [], [], [], []
    generate = m.engine.generate

    def generate_spy(*args, **kwargs):
        generated_under.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return generate(*args, **kwargs)

    monkeypatch.setattr(m.engine, "generate", generate_spy)
    spy(monkeypatch, "rollout_batch", rollouts)
    spy(monkeypatch, "ppo_policy_loss", losses)
    spy(monkeypatch, "kl_penalty", kls)
    metrics = ppo_step(run, cfg, 1)

    assert generated_under == [(True, torch.bfloat16)]  # sampling in the precision that is scored (B1)
    # Exactly, on every token: the first minibatch's ratio π/π_old is 1, the per-token KL(π‖π_ref) is 0.
    (logprobs, logprobs_old_mb, _, mb_mask, _), (_, stats) = losses[0]
    assert mb_mask.any() and torch.equal(logprobs[mb_mask.bool()], logprobs_old_mb[mb_mask.bool()])
    assert stats["ratio_mean"].item() == 1.0 and stats["ratio_max"].item() == 1.0 and stats["ratio_std"].item() == 0.0
    (logprobs_old, logprobs_ref, _), kl = kls[0]
    rollout = rollouts[0][1][0]
    mask = rollout.response_mask.bool()
    assert torch.equal(logprobs_old[mask], logprobs_ref[mask]) and (kl == 0).all()
    assert metrics["objective/kl"] == 0.0 and metrics["objective/kl_max"] == 0.0
    assert metrics["ppo/updates"] > 0

    # The reference log-probs are a bf16-autocast forward built here by hand: of fp32 copies of the bf16
    # checkpoint (full fine-tune: what the policy's masters hold), or of the bf16 checkpoint itself (LoRA: the
    # base). An fp32 forward of the same weights (what a "bf16" run computed before C5) is measurably different.
    by_hand = AutoModelForCausalLM.from_pretrained(files[0], dtype=torch.bfloat16).eval()
    if not lora:
        for p in by_hand.parameters():
            p.data = p.data.float()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        by_hand_bf16, _, _ = forward_response(by_hand, rollout, cfg.generation.temperature)
    with torch.no_grad():
        by_hand_fp32, _, _ = forward_response(by_hand, rollout, cfg.generation.temperature)
    assert torch.equal(logprobs_ref[mask], by_hand_bf16[mask])
    if not lora:  # (a bf16 base computes in bf16 with or without autocast)
        assert (by_hand_fp32[mask] - by_hand_bf16[mask]).abs().max() > 1e-4

    # After the update: still fp32 masters (and fp32 Adam moments); the reference did not move.
    assert all(p.dtype == torch.float32 for p in run.optim.policy_params + run.optim.critic_params)
    moments = [t for s in run.optim.policy_optimizer.state.values() for k, t in s.items() if k != "step"]
    assert moments and all(t.dtype == torch.float32 for t in moments)
    if lora:
        assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in m.policy_model.named_parameters()
                   if "lora_B" in n)
    else:
        assert any(not torch.equal(m.policy_model.state_dict()[k], v.float()) for k, v in checkpoint_bf16.items())
        after = m.policy.reference.state_dict()
        assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in reference_before.items())



def test_fp16_trains_through_the_loss_scaler_and_a_skipped_step_leaves_no_trace(files, tmp_path):
    cfg = tiny_config(tmp_path, *files, model__dtype="fp16", ppo__epochs=1, ppo__mini_batches=1,
                      ppo__early_stop=False)
    run = setup(cfg)
    scaler = run.optim.scaler
    assert scaler.is_enabled() and scaler.get_scale() == 2.0 ** 16  # torch's initial scale
    # An overflowing scale: the scaled loss's gradients through the fp16 activations are inf, so the step
    # must be skipped with the weights, Adam's state and the LR schedule as they were, and the scale halved.
    scaler = run.optim.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100)
    weights = {k: v.clone() for k, v in run.models.policy_model.state_dict().items()}
    head = {k: v.clone() for k, v in run.models.critic.state_dict().items()}
    lr_steps = run.optim.policy_scheduler.last_epoch
    metrics = ppo_step(run, cfg, 1)
    assert metrics["ppo/updates"] == 0 and metrics["health/skipped_updates"] == 1
    assert all(torch.equal(v, weights[k]) for k, v in run.models.policy_model.state_dict().items())
    assert all(torch.equal(v, head[k]) for k, v in run.models.critic.state_dict().items())
    assert not run.optim.policy_optimizer.state and not run.optim.critic_optimizer.state
    assert run.optim.policy_scheduler.last_epoch == lr_steps
    assert scaler.get_scale() == 2.0 ** 99
    # A scale that fits: three steps update with finite losses, the policy's parameters stay fp32.
    scaler.update(2.0 ** 12)
    for step in (2, 3, 4):
        metrics = ppo_step(run, cfg, step)
        assert metrics["ppo/updates"] == 1 and metrics["health/skipped_updates"] == 0
        for key in ("policy/loss", "value/loss", "policy/grad_norm", "value/grad_norm"):
            assert torch.isfinite(torch.tensor(metrics[key])), key
    assert scaler.get_scale() == 2.0 ** 12  # no overflow, and fewer than growth_interval (2000) steps
    assert all(p.dtype == torch.float32 for p in run.optim.policy_params)
    assert any(not torch.equal(v, weights[k]) for k, v in run.models.policy_model.state_dict().items())


def test_frozen_twin_computes_exactly_as_fp32_masters_under_autocast_on_a_tied_llama(tmp_path):
    """Llama-style blocks (RMSNorm, rotary, SwiGLU, tied embeddings): the twin's matmul weights are bf16, its
    embedding and norms fp32, and its log-probs equal the masters' to the bit; a reference cast to bf16
    everywhere (what a bf16 checkpoint loaded as is gives) is not exact."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tether.core.stats import logprobs_from_logits
    from tether.hf import upcast_trainable
    from tether.ppo.models import frozen_twin

    config = LlamaConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         intermediate_size=80, vocab_size=101, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    everywhere_bf16 = copy.deepcopy(loaded)
    twin = frozen_twin(loaded)
    masters = upcast_trainable(loaded)
    dtypes = {n.split(".")[-2]: p.dtype for n, p in twin.named_parameters()}
    assert dtypes["q_proj"] == dtypes["down_proj"] == torch.bfloat16
    assert dtypes["embed_tokens"] == dtypes["input_layernorm"] == dtypes["norm"] == torch.float32
    ids = torch.randint(3, 101, (3, 12))
    attention = torch.ones_like(ids)
    attention[0, :4] = 0  # a left-padded row

    def logprobs(model):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids, attention_mask=attention).logits
        return logprobs_from_logits(logits[:, :-1].float(), ids[:, 1:])

    assert torch.equal(logprobs(twin), logprobs(masters))
    assert not torch.equal(logprobs(everywhere_bf16), logprobs(masters))


@pytest.fixture
def fresh_accelerate_state():
    """accelerate's process state is a singleton that reads ACCELERATE_MIXED_PRECISION once, when the first
    Accelerator of the process is made: start from none (as a fresh `tether ppo` process does) and leave none."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_accelerate_mixed_precision_setting_is_ignored_with_one_line(files, tmp_path, monkeypatch, capsys,
                                                                     fresh_accelerate_state):
    """ACCELERATE_MIXED_PRECISION=bf16 (what `accelerate launch` exports from a default `accelerate config`)
    would have accelerate autocast the prepared policy and critic but not the frozen reference, so an fp32 run's
    step-1 KL was -7e-5 (max 6e-4) here instead of 0; with fp16 its GradScaler would scale the gradients tether
    clips. tether owns precision (--model-dtype): the Accelerator is made with mixed_precision "no", no forward
    of the policy runs under autocast, the KL is exactly 0, and one line on stderr says the setting is ignored."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    cfg = tiny_config(tmp_path, *files, ppo__mini_batches=2)
    run = setup(cfg)
    accelerator = run.processes.accelerator
    assert accelerator.mixed_precision == "no" and not accelerator.native_amp and accelerator.scaler is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ACCELERATE_MIXED_PRECISION=bf16" in err[0] and "--dtype bf16" in err[0]

    autocast_seen = []  # inside the policy: whether its blocks computed under autocast (score and update forwards)
    block = run.models.unwrapped_policy.transformer.h[0]
    block.register_forward_pre_hook(lambda mod, args: autocast_seen.append(torch.is_autocast_enabled("cpu")))
    metrics = ppo_step(run, cfg, 1)
    assert autocast_seen and not any(autocast_seen)
    assert metrics["objective/kl"] == 0.0 and metrics["objective/kl_max"] == 0.0
    assert metrics["ppo/updates"] > 0


@pytest.mark.parametrize("setting, dtype, says", [("fp16", "fp32", True), ("bf16", "bf16", False),
                                                  ("no", "fp32", False)])
def test_accelerate_mixed_precision_note_only_when_it_differs(files, tmp_path, monkeypatch, capsys,
                                                             fresh_accelerate_state, setting, dtype, says):
    """fp16 from accelerate is ignored too (its GradScaler never wraps tether's backward); a setting that agrees
    with --model-dtype, or "no", says nothing."""
    from tether.ppo.processes import make_processes

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", setting)
    cfg = tiny_config(tmp_path, *files, model__dtype=dtype)
    accelerator = make_processes(cfg).accelerator
    assert accelerator.mixed_precision == "no" and accelerator.scaler is None
    err = capsys.readouterr().err
    assert ("ignored" in err) == says and err.count("\n") == int(says)
