"""Sampling equals scoring (B1, B2): the checkpoint's own generation_config changes nothing tether samples,
the sampler's per-token distribution is the one the training-side forward scores, truncated sampling is
refused; and the phase timing of a step (C2)."""

import copy

import pytest
import torch
from tiny import make_policy_dir, make_prompts_file, tiny_config

from tether.errors import ConfigError
from tether.ppo.forward import forward_response, sequence_inputs
from tether.rollout.records import Rollout
from tether.rollout.sampling import encode_prompts, generate

# What instruct checkpoints ship in generation_config.json; each would change transformers' sampling.
LEAKY = {"repetition_penalty": 1.5, "top_k": 3, "top_p": 0.5, "min_p": 0.2, "no_repeat_ngram_size": 2,
         "temperature": 0.3, "suppress_tokens": [5], "do_sample": False}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    return make_policy_dir(root), make_prompts_file(root)


def _models(policy_dir):
    """The same weights twice: one with a neutral generation_config, one whose generation_config sets LEAKY."""
    from transformers import AutoModelForCausalLM

    from tether.hf import load_tokenizer

    tokenizer = load_tokenizer(policy_dir)
    plain = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    leaky = copy.deepcopy(plain)
    for key, value in LEAKY.items():
        setattr(leaky.generation_config, key, value)
    return tokenizer, plain, leaky


def _query(tokenizer):
    query, query_mask = encode_prompts(tokenizer, ["1+2=", "123+456=", "9=", "77+8="], 16, False)
    assert (query_mask == 0).any()  # left-padded rows of different lengths
    return query, query_mask


def _spy_scores(model) -> list:
    """Make ``model.generate`` also keep the processed scores (the logits after every processor generate
    applied, i.e. the log of the distribution each token was drawn from, up to a constant)."""
    kept, original = [], model.generate

    def spying_generate(*args, generation_config, **kwargs):
        config = copy.deepcopy(generation_config)
        config.output_scores, config.return_dict_in_generate = True, True
        out = original(*args, generation_config=config, **kwargs)
        kept.append(torch.stack(out.scores, dim=1))  # (B, T, V)
        return out.sequences

    model.generate = spying_generate
    return kept


@pytest.mark.parametrize("temperature, lora", [(1.0, False), (0.7, False), (0.7, True)])
def test_checkpoint_generation_config_changes_no_sample(files, temperature, lora):
    """Same seed, same weights: tether samples the same token ids whether or not the checkpoint's
    generation_config sets a repetition penalty, top-k, top-p, min-p, an n-gram ban, a suppressed token;
    also through a PEFT LoRA wrapper (which copies the base model's generation_config at generate)."""
    tokenizer, plain, leaky = _models(files[0])
    if lora:
        from peft import LoraConfig, get_peft_model

        plain, leaky = (get_peft_model(m, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
                        for m in (plain, leaky))
    query, query_mask = _query(tokenizer)
    rollouts = []
    for model in (plain, leaky):
        torch.manual_seed(0)
        rollouts.append(generate(model, tokenizer, query, query_mask, 12, temperature))
    assert rollouts[0].response.shape[1] > 3
    assert torch.equal(rollouts[0].response, rollouts[1].response)
    assert torch.equal(rollouts[0].response_mask, rollouts[1].response_mask)
    # the checkpoint's own settings are left as they were after sampling
    config = leaky.get_base_model().generation_config if lora else leaky.generation_config
    assert config.repetition_penalty == 1.5 and config.top_k == 3


def test_checkpoint_generation_config_changes_no_greedy_reply(files):
    tokenizer, plain, leaky = _models(files[0])
    query, query_mask = _query(tokenizer)
    a, b = (generate(m, tokenizer, query, query_mask, 12, greedy=True) for m in (plain, leaky))
    assert torch.equal(a.response, b.response)
    # greedy really is the argmax of the training-side logits at every valid token
    input_ids, attention_mask, position_ids = sequence_inputs(a.query, a.query_mask, a.response, a.response_mask)
    with torch.no_grad():
        out = plain(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    T = a.response.shape[1]
    argmax = out.logits[:, -(T + 1):-1].argmax(-1)
    assert torch.equal(argmax[a.response_mask.bool()], a.response[a.response_mask.bool()])


@pytest.mark.parametrize("temperature, min_new_tokens", [(1.0, 0), (0.7, 0), (1.3, 0), (0.7, 4)])
def test_sampler_distribution_is_the_one_scored(files, temperature, min_new_tokens):
    """For a checkpoint whose generation_config sets every leaky option, the sampler's own per-token
    log-probs (log_softmax of generate's processed scores) equal the training-side log-probs of
    softmax(logits / T) at every valid token; no token of the vocabulary was masked out, except EOS during
    the first min_new_tokens samples, which the training side masks the same way."""
    tokenizer, _, leaky = _models(files[0])
    query, query_mask = _query(tokenizer)
    kept = _spy_scores(leaky)
    torch.manual_seed(1)
    rollout = generate(leaky, tokenizer, query, query_mask, 12, temperature, min_new_tokens=min_new_tokens)
    scores = kept[0][:, :rollout.response.shape[1]].float()  # (B, T, V)
    mask = rollout.response_mask.bool()
    banned = torch.zeros_like(scores, dtype=torch.bool)
    banned[:, :min_new_tokens, list(rollout.eos_ids)] = True
    # no top-k / top-p / min-p / suppress mask was applied; the min_new_tokens EOS ban was
    assert torch.equal(torch.isinf(scores)[mask], banned[mask])
    sampler = torch.log_softmax(scores, -1).gather(-1, rollout.response[..., None])[..., 0]
    with torch.no_grad():
        trained, entropy, _ = forward_response(leaky, rollout, temperature)
    torch.testing.assert_close(trained[mask], sampler[mask], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(entropy[mask]).all()


@pytest.mark.parametrize("override, flag", [({"generation__top_p": 0.9}, "--top-p"),
                                            ({"generation__top_k": 20}, "--top-k")])
def test_truncated_sampling_is_refused(files, tmp_path, override, flag):
    with pytest.raises(ConfigError, match=flag):
        tiny_config(tmp_path, *files, **override)


def test_phase_timer_charges_a_split_block_to_its_parts(monkeypatch):
    import tether.ppo.perf as perf_module

    clock = [0.0]
    monkeypatch.setattr(perf_module, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    timer = perf_module.PhaseTimer()
    with timer("generate"):
        clock[0] += 1.0
    with timer("score"):
        clock[0] += 2.0
        timer.split("a")
        clock[0] += 4.0
        timer.split("b")
        clock[0] += 0.5  # after the last split: still b's
    assert timer.seconds == {"generate": 1.0, "a": 2.0, "b": 4.5}


def test_step_reports_each_phase(files, tmp_path, monkeypatch):
    """A fake clock that only moves inside each phase's work (by 1, 2, 4, 8, 16, 32 s) shows that each
    perf/seconds_* key holds exactly its own phase, that seconds_score is the sum of the four scoring parts,
    and that weight sync is 0.0 with the transformers engine (it samples from the trained weights)."""
    import tether.ppo.perf as perf_module
    import tether.ppo.step as step_module
    from tether.ppo.setup import setup

    cfg = tiny_config(tmp_path, *files)
    run = setup(cfg)
    clock = [0.0]
    monkeypatch.setattr(perf_module, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))

    def ticking(fn, *seconds):
        calls = []

        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            clock[0] += seconds[len(calls)] if len(calls) < len(seconds) else 0.0  # later calls: the train phase
            calls.append(1)
            return out
        return wrapped

    import tether.ppo.draw as draw_module

    # the reward sources score in the draw (before the forwards, so a flat group costs no forward: B18)
    for module, name, seconds in [(step_module, "rollout_batch", (1.0,)), (step_module, "forward_response", (2.0, 4.0)),
                                  (step_module, "critic_values", (8.0,)), (draw_module, "score_rollout", (16.0,)),
                                  (step_module, "ppo_epochs", (32.0,))]:
        monkeypatch.setattr(module, name, ticking(getattr(module, name), *seconds))
    metrics = step_module.ppo_step(run, cfg, 1)
    expected = {"generate": 1.0, "weight_sync": 0.0, "weight_gather": 0.0, "weight_transfer": 0.0,
                "logprobs_old": 2.0, "reference": 4.0, "values": 8.0, "reward": 16.0, "score": 30.0, "train": 32.0,
                "step": 63.0}
    assert {k: metrics[f"perf/seconds_{k}"] for k in expected} == expected
    assert metrics["perf/rollout_share"] == 1.0 / 63.0


def test_an_engine_with_its_own_weights_is_synced_before_sampling(files, tmp_path, monkeypatch):
    """The engine seam (C3): the step asks a weight-holding engine to sync before it samples and reports that
    time as perf/seconds_weight_sync (fake clock: 64 s), split as the engine measured it into gather and transfer;
    evaluation, which follows an update, syncs first too; the transformers engine syncs nothing (0.0 above)."""
    import tether.ppo.perf as perf_module
    import tether.ppo.step as step_module
    from tether.ppo.evaluate import evaluate
    from tether.ppo.setup import setup
    from tether.rollout.engines import TransformersEngine
    from tether.rollout.weights import SyncSeconds

    cfg = tiny_config(tmp_path, *files, data__eval_fraction=0.25)
    run = setup(cfg)
    assert isinstance(run.models.engine, TransformersEngine) and not run.models.engine.syncs_weights
    clock, calls = [0.0], []
    monkeypatch.setattr(perf_module, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))

    class CopyingEngine(TransformersEngine):
        name, syncs_weights = "copying", True

        def sync_weights(self, model):
            assert model is run.models.unwrapped_policy
            calls.append("sync")
            clock[0] += 64.0
            self.sync_seconds = SyncSeconds(gather=24.0, transfer=40.0)

        def generate(self, *args, **kwargs):
            calls.append("generate")
            return super().generate(*args, **kwargs)

    run.models.engine = CopyingEngine(run.models.unwrapped_policy, run.models.tokenizer)
    metrics = step_module.ppo_step(run, cfg, 1)
    assert calls == ["sync", "generate"]
    assert metrics["perf/seconds_weight_sync"] == 64.0 and metrics["perf/seconds_step"] == 64.0
    assert (metrics["perf/seconds_weight_gather"], metrics["perf/seconds_weight_transfer"]) == (24.0, 40.0)
    calls.clear()
    evaluate(run, cfg, 1)
    assert calls[0] == "sync" and calls[1:] and set(calls[1:]) == {"generate"}


def saved_for_backward_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn`` runs (each saved tensor counted once per
    save, as it is kept)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


def test_no_entropy_graph_without_an_entropy_bonus(tmp_path):
    """c2 = 0 (the default): the loss has no entropy term, so the training forward must not build the entropy's
    graph — with a 32k vocabulary its (B, T, V) softmax is the largest tensor saved for backward (the review
    measured −42% saved memory and a 26% faster train phase without it). With c2 > 0 the term trains. On the
    output-embedding path (the default wherever it is checked equal) no (B, T, V) tensor is saved at all, with or
    without the bonus: each chunk's logits are recomputed in backward."""
    from tether.demo.task import build_policy, build_tokenizer
    from tether.ppo.forward import ForwardOptions
    from tether.ppo.records import Experience
    from tether.ppo.setup import setup
    from tether.ppo.update import minibatch_loss

    policy_dir = tmp_path / "policy32k"
    tokenizer = build_tokenizer(policy_dir)
    model = build_policy(tokenizer, seed=0, n_layer=1, n_embd=32, n_head=2)
    model.resize_token_embeddings(32_000)
    model.save_pretrained(policy_dir)
    prompts = make_prompts_file(tmp_path)
    B, P, T = 4, 6, 8
    g = torch.Generator().manual_seed(0)
    ids = lambda *shape: torch.randint(3, len(tokenizer), shape, generator=g)  # noqa: E731
    rollout = Rollout(query=ids(B, P), query_mask=torch.ones(B, P, dtype=torch.long), response=ids(B, T),
                      response_mask=torch.ones(B, T, dtype=torch.long), ended_with_eos=torch.ones(B, dtype=torch.bool))
    zeros = torch.zeros(B, T)
    experience = Experience(rollout=rollout, logprobs_old=zeros - 10.0, logprobs_ref=zeros - 10.0, values_old=zeros,
                            last_values=torch.zeros(B), scores=torch.zeros(B), kl=zeros, rewards=zeros,
                            advantages=torch.randn(B, T, generator=g), returns=zeros)
    saved, grads = {}, {}
    for coef in (0.0, 0.01):
        cfg = tiny_config(tmp_path / f"c{coef}", policy_dir, prompts, ppo__entropy_coef=coef)
        run = setup(cfg)
        assert run.models.forward.own_head  # checked equal to the model's logits at set-up
        for path in ("logits", "own_head"):
            if path == "logits":
                run.models.forward = ForwardOptions()
            else:
                run.models.forward = ForwardOptions(own_head=True)
            run.optim.policy_optimizer.zero_grad(set_to_none=True)
            saved[coef, path] = saved_for_backward_bytes(
                lambda: minibatch_loss(run, cfg, experience, critic_only=False, weight=torch.tensor(1.0)))
            grads[coef, path] = torch.cat([q.grad.flatten() for q in run.optim.policy_params if q.grad is not None])
    logits_bytes = B * (T + 1) * 32_000 * 4
    assert saved[0.01, "logits"] - saved[0.0, "logits"] >= logits_bytes, saved  # the softmax (and its product)
    assert saved[0.0, "logits"] < 0.7 * saved[0.01, "logits"], saved
    # own head: at least one (B, T, V) fp32 tensor fewer than the logits path even without the bonus, and the bonus
    # adds no vocabulary-sized tensor (what both save alike is the (V, H) embedding matrix the head multiplies by)
    assert saved[0.0, "logits"] - saved[0.0, "own_head"] >= B * T * 32_000 * 4, saved
    assert saved[0.01, "own_head"] - saved[0.0, "own_head"] < B * T * 32_000 * 4 / 10, saved
    for coef in (0.0, 0.01):  # the same gradients either way, and the bonus changes them
        torch.testing.assert_close(grads[coef, "own_head"], grads[coef, "logits"], atol=1e-6, rtol=1e-4)
    assert not torch.allclose(grads[0.01, "own_head"], grads[0.0, "own_head"])


def test_output_embedding_logprobs_equal_the_logits_path_at_a_49k_vocabulary(tmp_path):
    """#39 item 2 at SmolLM2's vocabulary (49,152): log-probs and entropy through the output embedding, at the valid
    response tokens only and in chunks (here 7 tokens, so chunks cross rows), equal log_softmax of the model's full
    (B, T, V) logits / T gathered at the response tokens — computed here by hand from the logits — and the gradients
    of a loss on them agree; min_new_tokens' EOS ban applies on both paths."""
    from tether.demo.task import build_policy, build_tokenizer
    from tether.ppo.forward import ForwardOptions

    tokenizer = build_tokenizer(tmp_path / "tok")
    model = build_policy(tokenizer, seed=0, n_layer=1, n_embd=32, n_head=2)
    model.resize_token_embeddings(49_152)
    B, P, T, temperature = 3, 5, 6, 0.7
    g = torch.Generator().manual_seed(0)
    response = torch.randint(3, 49_152, (B, T), generator=g)
    response_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4])
    eos = (tokenizer.eos_token_id,)
    rollout = Rollout(query=torch.randint(3, 49_152, (B, P), generator=g), query_mask=torch.ones(B, P, dtype=torch.long),
                      response=response, response_mask=response_mask, ended_with_eos=torch.zeros(B, dtype=torch.bool),
                      eos_ids=eos, min_new_tokens=2)
    input_ids = torch.cat([rollout.query, response], 1)
    logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits[:, P - 1:-1].float()
    logits = logits / temperature
    logits[:, :2, list(eos)] = float("-inf")  # min_new_tokens = 2: EOS cannot be the first two tokens
    by_hand = torch.log_softmax(logits.double(), -1)  # float64: the reference's own rounding out of the way
    want_lp = by_hand.gather(-1, response[..., None])[..., 0]
    want_ent = -(by_hand.exp() * by_hand.nan_to_num(neginf=0.0)).sum(-1)
    mask = response_mask.bool()
    grads = []
    for options in (ForwardOptions(), ForwardOptions(own_head=True, chunk_tokens=7)):
        model.zero_grad()
        lp, ent, _ = forward_response(model, rollout, temperature, options=options)
        torch.testing.assert_close(lp[mask].double(), want_lp[mask].detach(), atol=2e-5, rtol=1e-5)
        # an fp32 sum over 49,152 terms: relative rounding ~ sqrt(V)·2^-24 = 1.3e-5 (entropy ~ log V = 10.8)
        torch.testing.assert_close(ent[mask].double(), want_ent[mask].detach(), atol=1e-5, rtol=5e-5)
        if options.own_head:  # nothing computed past a row's end
            assert not lp[~mask].any()
        (lp[mask].sum() + 0.1 * ent[mask].sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    # the same gradient up to fp32 rounding over the vocabulary (measured: 3.7e-5 of its norm, 4.7e-5 of its largest
    # entry); a wrong token, position or temperature moves it by O(1)
    diff = grads[1] - grads[0]
    assert diff.norm() < 1e-4 * grads[0].norm() and diff.abs().max() < 1e-4 * grads[0].abs().max()
