"""Rejection-sampling data (S4; Best-of-N distillation, "RFT"): K samples per prompt from a policy, kept when a rule or
a reward model accepts them, written as SFT rows — the standard way to SFT a small model onto a task before RL
(`tether sample`, then `tether sft --data` on its output).

Why a command of its own and not an SFT data source: sampling is the expensive half (a real model's K samples per
prompt take longer than training on the kept ones), so its output is kept, read, filtered again and reused across SFT
runs and seeds; it may use another engine (``--engine vllm``) and another machine than training; and the counts that
say whether the task is in the model's reach (pass@K, kept/total) come before any training is spent.

The prompts are read as ``tether ppo`` reads them (:mod:`tether.inputs.prompt_rows`: prompt, GSM8K, SVAMP, HH or message
shapes, the other columns kept) and the policy is asked as ``tether ppo`` asks it (chat template, ``--system-prompt``,
``--prompt-template``; :func:`tether.sft.evaluate.generate_responses` over a :mod:`tether.rollout` engine), from
exactly softmax(logits / T). Each sample gets the sum of the ``--reward`` scores, combined as PPO combines them
(:func:`scores_of`: a rule's None leaves the sample to the others) — rules called as PPO calls them, with the row's
columns and ``ended_with_eos`` (:func:`tether.rules.calls.call_rule`), reward models' standardised scores (several:
their mean) — and is **accepted** when that sum is finite and ≥ ``--min-score`` and, with
``--require-eos`` (the default), it ended with EOS (a cut reply is no demonstration). Per prompt, the accepted
samples (distinct texts) are kept best first: ``--keep best`` the top one (Best-of-N), ``--keep all`` up to
``--max-per-prompt`` (0 = every one; RFT keeps distinct correct ones); ``--keep pairs`` writes preference pairs
instead, accepted ≻ rejected samples of the same prompt, for ``tether train-rm`` (:func:`preference_pairs`).

Output: JSONL rows ``{"prompt": <as given>, "completion": <sample>, <the prompt row's columns>, "score": s}`` — ``tether
sft`` with the same ``--system-prompt``/``--prompt-template`` trains on the very context the samples were drawn in —
or with ``--format messages`` ``{"messages": [system?, user (templated), assistant], ...}``, the context baked in;
and ``FILE.summary.json``: the counts (prompts, samples, ended with EOS, accepted, kept, prompts with one kept at
least, kept/total) and the config.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tether.config import MAX_NEW_TOKENS, as_config, config_to_dict, option
from tether.errors import ConfigError, TetherError
from tether.hf import DTYPE_ALIASES, DTYPES


@dataclass
class SampleModel:
    policy: str = option("", "the policy that samples: a local causal-LM directory, a preset name or a Hub id",
                         flag="--policy")
    dtype: str = option("fp32", "compute dtype of the sampling (bf16/fp16 under autocast)", choices=tuple(DTYPES),
                        flag="--dtype", value_aliases=DTYPE_ALIASES, old_flags=("--model-dtype",))
    trust_remote_code: bool = option(False, "allow model code from the model directory (off unless asked)")


@dataclass
class SampleData:
    prompts: str = option("", "prompt file (tether ppo's shapes: prompt, GSM8K, SVAMP, HH, messages), "
                          "hf:org/name[:config][:split], or a task "
                          "rg:DATASET[:key=value,...]: its training rows as tether ppo splits them with the same "
                          "data.task_* settings (held-out rows never sampled)", flag="--prompts")
    task_train: int = option(2000, "rg: tasks: training problems (as tether ppo's data.task_train)", low=1)
    task_eval: int = option(200, "rg: tasks: held-out problems left out (as tether ppo's data.task_eval)", low=0)
    task_seed: int = option(0, "rg: tasks: the generator's seed (as tether ppo's data.task_seed)")
    max_prompts: int = option(0, "use only the first N prompts (0 = all)", low=0, flag="--max-prompts")
    chat_template: str = option("auto", "wrap prompts in the tokenizer's chat template", choices=("auto", "on", "off"))
    system_prompt: str = option("", "system turn for the chat template ('' = the template's default), as in tether "
                                "ppo", flag="--system-prompt")
    prompt_template: str = option("{prompt}", "what the policy is asked: '{prompt}' is replaced by the prompt, as in "
                                  "tether ppo", flag="--prompt-template")
    max_prompt_length: int = option(512, "prompts longer than this (tokens) are cut from the left", low=1)


@dataclass
class SampleGeneration:
    engine: str = option("transformers", "rollout engine: 'transformers' generate, or 'vllm' (optional install)",
                         choices=("transformers", "vllm"), flag="--engine")
    engine_tp: int = option(1, "vLLM tensor parallelism (processes per engine); 1 here", low=1, high=1,
                           flag="--engine-tp", old_flags=("--generation-engine-tp",))
    max_new_tokens: int = option(MAX_NEW_TOKENS, "sample length cap; samples cut here did not end with EOS", low=1,
                                 flag="--max-new-tokens")
    temperature: float = option(1.0, "sampling temperature (softmax(logits / T), nothing truncated)", low=0.0,
                                low_open=True, flag="--temperature")


@dataclass
class SampleAccept:
    sources: list[str] = option([], "what judges a sample: a rule module:function[:key=value,...] or a reward-model "
                                "directory; repeatable (scores summed; several reward models: their mean)",
                                flag="--reward", repeat=True)
    min_score: float = option(0.5, "a sample is accepted when its score is >= this (rules' 1/0 verdicts: 0.5; a "
                              "reward model's standardised score: in standard deviations)", flag="--min-score")
    require_eos: bool = option(True, "accept only samples that ended with EOS (never a reply cut by "
                               "--max-new-tokens)", flag="--require-eos")
    keep: str = option("all", "per prompt: 'all' accepted distinct samples (best first, up to --max-per-prompt), "
                       "the 'best' one (Best-of-N), or 'pairs': each accepted sample ≻ each rejected one of the "
                       "same prompt, as preference pairs for tether train-rm", choices=("all", "best", "pairs"),
                       flag="--keep")
    max_per_prompt: int = option(0, "--keep all|pairs: at most this many rows per prompt (0 = every one)", low=0,
                                 flag="--max-per-prompt")
    pair_length_gap: int = option(0, "--keep pairs: only pairs whose two replies differ in length by at most this "
                                  "many characters (0 = any): length-matched pairs, so that a reward model cannot "
                                  "learn 'the shorter reply wins' in place of the task", low=0,
                                  flag="--pair-length-gap")


@dataclass
class SampleConfig:
    """``tether sample``: one config, nested by concern; defaults <- YAML (--config) <- flags."""

    output: str = option("", "the JSONL file of kept rows (FILE.summary.json beside it)", flag="--output")
    samples_per_prompt: int = option(8, "K: samples drawn per prompt", low=1, flag="--samples-per-prompt")
    batch_size: int = option(8, "prompts per generate call (each sampled K times)", low=1, flag="--batch-size")
    seed: int = option(0, "sampling seed", flag="--seed")
    format: str = option("completion", "rows as prompt + completion (the prompt as given) or as messages (the "
                         "chat context baked in)", choices=("completion", "messages"), flag="--format")
    progress: bool = option(True, "show a progress bar")
    model: SampleModel = field(default_factory=SampleModel)
    data: SampleData = field(default_factory=SampleData)
    generation: SampleGeneration = field(default_factory=SampleGeneration)
    accept: SampleAccept = field(default_factory=SampleAccept)

    @property
    def rows_per_step(self) -> int:
        """Samples per generate call (what the vLLM engine sizes its batch for)."""
        return self.batch_size * self.samples_per_prompt

    def validate(self) -> None:
        for key, value in (("--policy", self.model.policy), ("--prompts", self.data.prompts),
                           ("--output", self.output)):
            if not value:
                raise ConfigError(f"{key}: required")
        if not self.accept.sources:
            raise ConfigError("--reward: at least one rule or reward model is required (what accepts a sample)")
        if "{prompt}" not in self.data.prompt_template:
            raise ConfigError(f"--prompt-template: {self.data.prompt_template!r} does not contain {{prompt}}")
        if self.accept.keep == "pairs" and self.format == "messages":
            raise ConfigError("--keep pairs: rows are prompt/chosen/rejected text pairs; --format messages is for SFT "
                              "rows")


@dataclass
class SampleResult:
    """What ``tether sample`` wrote and counted."""

    output: Path
    counts: dict
    rows: list[dict]


def reward_scorers(specs: list[str], given: dict, device) -> list:
    """``(prompts, responses, fields, ended) -> ((B,) scores, rows it does not apply to)`` scorers: reward-model
    directories (one ensemble, their mean; they judge every row), rules and callables given from Python
    (``given[spec]``; a row they return None for is left to the other scorers, as PPO leaves it: :func:`scores_of`)."""
    from tether.presets import is_model_spec
    from tether.rm.model import METADATA_FILE, RewardEnsemble, RewardModel
    from tether.rules import load_rule

    dirs = [s for s in specs if s not in given and ((Path(s) / METADATA_FILE).is_file() or is_model_spec(s))]
    scorers = []
    if dirs:
        models = [RewardModel.from_pretrained(d, device=device) for d in dirs]
        model = models[0] if len(models) == 1 else RewardEnsemble(models, "mean")
        scorers.append(lambda prompts, responses, fields, ended: (model.score(prompts, responses).float().cpu(),
                                                                  set()))
    for spec in specs:
        if spec in dirs:
            continue
        rule = given.get(spec) or load_rule(spec, flag="--reward")
        scorers.append(lambda prompts, responses, fields, ended, rule=rule: _rule_scores(rule, prompts, responses,
                                                                                          fields, ended))
    return scorers


def _rule_scores(rule, prompts, responses, fields, ended) -> tuple[torch.Tensor, set[int]]:
    from tether.rules.calls import call_rule

    not_applicable: set[int] = set()
    return call_rule(rule, prompts, responses, fields, ended, not_applicable=not_applicable), not_applicable


def scores_of(scorers: list, prompts: list[str], responses: list[str], fields: dict, ended) -> torch.Tensor:
    """(B,) the samples' scores, combined as PPO combines its sources (:func:`tether.rules.calls.judged_sum`): Σ of
    the scorers' scores, each counting only on the rows it judged — a rule's None ("does not apply") leaves the row
    to the others, not a NaN that drops the sample; a row no scorer judged, or one a rule failed on, is NaN."""
    from tether.rules.calls import judged_sum

    return judged_sum([scorer(prompts, responses, fields, ended) for scorer in scorers], len(responses))


def kept_rows(chunk: list[dict], responses: list[str], scores: list[float], ended: list[bool], k: int, cfg,
              counts: dict) -> list[dict]:
    """The rows kept from one chunk's samples (``k`` adjacent samples per prompt), best first per prompt; a text
    sampled twice (up to surrounding whitespace) is one row, with its best score."""
    a = cfg.accept
    if a.keep == "pairs":
        return preference_pairs(chunk, responses, scores, ended, k, cfg, counts)
    out = []
    for i, row in enumerate(chunk):
        distinct: dict[str, tuple[float, str]] = {}  # stripped text -> (best score, the text as sampled)
        for j in range(i * k, (i + 1) * k):
            if math.isfinite(scores[j]) and scores[j] >= a.min_score and (ended[j] or not a.require_eos):
                counts["accepted"] += 1
                key = responses[j].strip()
                if key not in distinct or scores[j] > distinct[key][0]:
                    distinct[key] = (scores[j], responses[j])
        ranked = sorted(distinct.values(), key=lambda pair: -pair[0])  # ties: the first sampled first
        limit = 1 if a.keep == "best" else (a.max_per_prompt or len(ranked))
        out += [sample_row(row, text, score, cfg) for score, text in ranked[:limit]]
        counts["prompts_with_kept"] += bool(ranked)
    return out


def preference_pairs(chunk: list[dict], responses: list[str], scores: list[float], ended: list[bool], k: int, cfg,
                     counts: dict) -> list[dict]:
    """``--keep pairs``: per prompt, every distinct accepted text (chosen) paired with every distinct rejected one —
    a finite score below ``--min-score``, or (``--require-eos``) a reply cut short — as ``{"prompt", "chosen",
    "rejected", <the row's columns>, "chosen_score", "rejected_score"}``, the policy's own samples labelled by the
    rule (the classic pipeline's reward-model data). A text both accepted and rejected (a cut reply equal to an
    ended one) cannot be told apart and gives no pair; a NaN score or an empty reply is neither; prompts whose samples all passed or
    all failed give none. Up to ``--max-per-prompt`` pairs a prompt, the best chosen and the worst rejected first;
    with ``--pair-length-gap N`` only pairs whose stripped texts differ by at most N characters (length-matched)."""
    a = cfg.accept
    out = []
    for i, row in enumerate(chunk):
        chosen: dict[str, tuple[float, str]] = {}    # stripped text -> (best score, the text as sampled)
        rejected: dict[str, tuple[float, str]] = {}  # stripped text -> (worst score, the text as sampled)
        for j in range(i * k, (i + 1) * k):
            key, accepted = responses[j].strip(), scores[j] >= a.min_score and (ended[j] or not a.require_eos)
            counts["accepted"] += accepted
            if not math.isfinite(scores[j]) or not key:  # an empty reply: train-rm takes no empty side
                continue
            side, better = (chosen, scores[j] > chosen.get(key, (-math.inf,))[0]) if accepted else \
                (rejected, scores[j] < rejected.get(key, (math.inf,))[0])
            if better:
                side[key] = (scores[j], responses[j])
        pairs = [(c, r) for c in sorted(chosen, key=lambda t: -chosen[t][0])
                 for r in sorted(rejected, key=lambda t: rejected[t][0])
                 if c != r and (not a.pair_length_gap or abs(len(c) - len(r)) <= a.pair_length_gap)]
        columns = {key: v for key, v in row.items() if key != "prompt"}
        out += [{**columns, "prompt": row["prompt"], "chosen": chosen[c][1], "rejected": rejected[r][1],
                 "chosen_score": chosen[c][0], "rejected_score": rejected[r][0]}
                for c, r in pairs[:a.max_per_prompt or len(pairs)]]
        counts["prompts_with_kept"] += bool(pairs)
    return out


def sample_row(row: dict, completion: str, score: float, cfg) -> dict:
    """One SFT row: the prompt row's columns, then the prompt (or the messages) and the kept sample."""
    columns = {k: v for k, v in row.items() if k != "prompt"}
    if cfg.format == "messages":
        from tether.rollout.sampling import prompt_messages

        messages = prompt_messages(row["prompt"], cfg.data.system_prompt, cfg.data.prompt_template)
        return {**columns, "messages": messages + [{"role": "assistant", "content": completion}], "score": score}
    return {**columns, "prompt": row["prompt"], "completion": completion, "score": score}


def load_policy_for_sampling(cfg: SampleConfig):
    """The policy (eval mode, on the GPU when there is one), its tokenizer and whether prompts use its chat
    template (checked as ``tether ppo`` checks it)."""
    from tether.hf import load_causal_lm, load_tokenizer
    from tether.presets import resolve_model_path

    path = resolve_model_path(cfg.model.policy, what="policy")
    tokenizer = load_tokenizer(path, cfg.model.trust_remote_code)
    model = load_causal_lm(path, cfg.model.dtype, cfg.model.trust_remote_code).eval()
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if cfg.data.chat_template == "on" and not has_template:
        raise TetherError(f"--policy {cfg.model.policy}: data.chat_template=on but the tokenizer has no chat template")
    use = cfg.data.chat_template == "on" or (cfg.data.chat_template == "auto" and has_template)
    if (cfg.data.system_prompt or cfg.format == "messages") and not use:
        raise TetherError(f"--system-prompt / --format messages: the policy {cfg.model.policy} is not prompted "
                          "through a chat template (data.chat_template)")
    return model, tokenizer, use


def rejection_sample(config, reward=None, prompts=None) -> SampleResult:
    """Run ``tether sample`` (module docstring). ``config``: a :class:`SampleConfig`, a dict of its keys or a YAML
    path; ``reward``: callables with the rule signature (a dict ``{name: fn}``, or one), beside ``accept.sources``
    (recorded as ``python:NAME``); ``prompts``: a ``datasets.Dataset`` or a list of prompt rows in place of the
    file. Returns the rows kept and the counts (also written)."""
    from tqdm.auto import tqdm

    from tether.precision import Precision
    from tether.inputs.prompt_rows import collate_fields, load_prompts, prompts_from_data
    from tether.rules.calls import completion_ids, with_completion_ids
    from tether.rollout.engines import make_engine
    from tether.sft.evaluate import Prompting, generate_responses

    started = time.perf_counter()
    cfg = as_config(SampleConfig, config, check=False)
    named = reward if isinstance(reward, dict) else {} if reward is None else {getattr(reward, "__name__", "reward"): reward}
    given = {f"python:{name}": fn for name, fn in named.items()}
    cfg.accept.sources = [*cfg.accept.sources, *(s for s in given if s not in cfg.accept.sources)]
    if prompts is not None and not cfg.data.prompts:
        cfg.data.prompts = "python:prompts"
    cfg = as_config(SampleConfig, cfg)
    if prompts is not None:
        rows = prompts_from_data(prompts, "prompts")
    elif cfg.data.prompts.startswith("rg:"):  # a generated task: its training rows, as tether ppo splits it
        from tether.tasks import split_rows

        rows = split_rows(cfg.data.prompts, cfg.data.task_train, cfg.data.task_eval, cfg.data.task_seed)[0]
    else:
        rows = load_prompts(cfg.data.prompts)
    rows = rows[:cfg.data.max_prompts] if cfg.data.max_prompts else rows
    torch.manual_seed(cfg.seed)
    model, tokenizer, use_chat = load_policy_for_sampling(cfg)
    device = next(model.parameters()).device
    scorers = reward_scorers(cfg.accept.sources, given, device)
    engine = make_engine(cfg, model, tokenizer)
    precision = Precision(DTYPES[cfg.model.dtype], device.type)
    prompting = Prompting(use_chat, cfg.data.system_prompt, cfg.data.prompt_template, cfg.data.max_prompt_length)
    k, g = cfg.samples_per_prompt, cfg.generation
    counts = {"prompts": len(rows), "samples": 0, "ended_with_eos": 0, "accepted": 0, "kept": 0, "prompts_with_kept": 0}
    kept: list[dict] = []
    try:
        for start in tqdm(range(0, len(rows), cfg.batch_size), desc="sample", disable=not cfg.progress):
            chunk = rows[start:start + cfg.batch_size]
            repeated = [r for r in chunk for _ in range(k)]  # K adjacent samples per prompt
            prompts_k = [r["prompt"] for r in repeated]
            rollout, responses = generate_responses(engine, tokenizer, prompts_k, prompting, g.max_new_tokens, device,
                                                    g.temperature, precision=precision)
            ended = [bool(e) for e in rollout.ended_with_eos]
            fields = with_completion_ids(collate_fields(repeated), completion_ids(rollout))
            scores = scores_of(scorers, prompts_k, responses, fields, rollout.ended_with_eos)
            counts["samples"] += len(responses)
            counts["ended_with_eos"] += sum(ended)
            kept += kept_rows(chunk, responses, [float(s) for s in scores], ended, k, cfg, counts)
    finally:
        engine.close()
    counts["kept"] = len(kept)
    counts.update(kept_fraction=counts["kept"] / counts["samples"],
                  accepted_fraction=counts["accepted"] / counts["samples"],
                  prompts_with_kept_fraction=counts["prompts_with_kept"] / counts["prompts"],
                  seconds=round(time.perf_counter() - started, 1))
    return SampleResult(write_rows(Path(cfg.output), kept, counts, cfg), counts, kept)


def write_rows(path: Path, rows: list[dict], counts: dict, cfg: SampleConfig) -> Path:
    """The rows as JSONL and ``PATH.summary.json`` (counts and config), each written whole or not at all."""
    from tether.runlog import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    summary = {"counts": counts, "config": config_to_dict(cfg)}
    write_text_atomic(path.with_name(path.name + ".summary.json"), json.dumps(summary, indent=1) + "\n")
    return path
