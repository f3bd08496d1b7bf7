"""The demo's synthetic task — 3-digit addition — with its gold rule, character tokenizer and tiny policy.

Task. A prompt is two zero-padded operands and an equals sign, ``"123+045="`` (always
``prompt_width()`` = 8 characters, so a batch of prompts needs no padding and every answer starts at the
same position); the answer is the sum written **units digit first**, zero-padded to one digit more than
the operands, as the operands are padded: 123 + 45 = 168 is answered ``"8610"`` (always 4 digits, 0..1998
reversed; 999 + 1 = 1000 is ``"0001"``). The policy learns to write the answer and then ``[EOS]``. There
are 1000 × 1000 = 10⁶ distinct problems; ``digits=2`` gives the 10⁴-problem variant ``"12+34="`` →
``"640"`` and ``"12+59="`` → ``"170"``.

Why units first. Written the usual way, the first digit of a sum depends on every carry below it: a small
model must finish the whole addition before it writes anything, and a reward model that reads the answer
must redo it to check any digit but the last. Written units first, each digit depends only on the two
operand digits at its place and the carry out of the digit just written, the order in which people add by
hand (Lee et al. 2023, "Teaching arithmetic to small transformers", found the same for learning). Measured
here with the 3-layer policy below (issue #18, ``docs/demo.md``): with 3-digit operands the usual order
needed up to 2,000 SFT steps to reach a useful start and gave a reward model that checked the units digit
only; units first, SFT got there in 400 steps, but the reward model still reached only 72% on held-out
pairs. The demo therefore uses ``digits=2``: SFT in 200–300 steps, a reward model at 80–94%.

Why a fixed width. Written without padding, answers of 2 and 3 digits put the reward model's score
(read at the ``[EOS]`` after the reply) at two different positions, and the 3-layer reward model learned a
separate check for each digit of each length, only some of them within the demo's budget: measured on
±1 corruptions of held-out answers, every seed's reward model was at chance on some (position, length)
pairs — e.g. the tens digit of every answer for seed 2 — and PPO could then fix only the digits its reward
model checked (issue #18, ``docs/demo.md``). With every answer ``digits + 1`` characters long, the digits
and the ``[EOS]`` sit at the same positions in every answer; over five seeds the (digit, sum size) cells a
reward model left at chance fell from 11 of 30 to 4 of 30 (units and tens digits). Not a full fix: the
final carry stays unchecked.

Gold rule. A response — the text the policy generated, decoded *without* special tokens — is correct
iff it equals the answer exactly: all ``digits + 1`` digits (the padding zeros included), no surrounding
spaces, no extra text
(``gold_reward``). The rule sees text only. The SFT/evaluation helpers in ``tether.demo.sft`` and
``tether.demo.pairs`` (``gold_accuracy``, ``make_preference_pairs``) additionally require the response
to have ended with ``[EOS]``: a response cut off by ``max_new_tokens`` is wrong even if its text
matches. During PPO, whether a response ended with EOS is the trainer's business (SPEC B1/B4).

Why this task. With the 0.6M-parameter policy below, SFT on a 2-core CPU learns addition in sudden jumps,
so it can be stopped while *partially* competent, leaving room for RL (``shared/notes/demo-feasibility.md``:
gold-reward RL from ~33% reaches ~44% in 3 minutes). When the jump comes varies with the seed, so
``tether.demo.sft.sft_to_accuracy`` stops at a target (dev pass@8) instead of a fixed step count.

Train and held-out problems are drawn from separate seeded streams and never overlap
(``split_problems``); the held-out set depends only on ``(seed, n_eval)``, not on ``n_train``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

DIGITS = 3  # these functions' default; ``tether demo`` uses ``digits=2`` (see "Why units first")
PAD, EOS, UNK = "[PAD]", "[EOS]", "[UNK]"
# Digits and the task's symbols, plus a space and lowercase letters so that a policy drifting off-task
# (e.g. PPO with β = 0 gaming a reward model) can write something other than digits, visibly.
CHARACTERS = "0123456789+-= abcdefghijklmnopqrstuvwxyz"


def prompt_width(digits: int = DIGITS) -> int:
    """Characters (= tokens) in every prompt: two operands, ``+`` and ``=`` (8 for 3 digits)."""
    return 2 * digits + 2


def answer_text(total: int, width: int = 0) -> str:
    """A sum's decimal digits, zero-padded to ``width``, units first (``168`` → ``"861"``; width 4: ``"8610"``;
    ``1000`` → ``"0001"``)."""
    return str(total).zfill(width)[::-1]


def problem(a: int, b: int, digits: int = DIGITS) -> dict[str, str]:
    """The problem ``a + b`` as ``{"prompt": "aaa+bbb=", "answer": answer_text(a + b, digits + 1)}`` (operands
    zero-padded to ``digits``, the answer to ``digits + 1``)."""
    if digits < 1 or not (0 <= a < 10**digits and 0 <= b < 10**digits):
        raise ValueError(f"operands must be in 0..{10**digits - 1}, got {a} and {b}")
    return {"prompt": f"{a:0{digits}d}+{b:0{digits}d}=", "answer": answer_text(a + b, digits + 1)}


def solve(prompt: str) -> str:
    """The gold answer (units first) of a prompt ``"aaa+bbb="`` (operands of equal width); ``ValueError`` otherwise."""
    left, plus, right = prompt.partition("+")
    a, b = left, right[:-1]
    well_formed = plus and right.endswith("=") and len(a) == len(b) > 0
    if not (well_formed and a.isascii() and b.isascii() and a.isdigit() and b.isdigit()):
        raise ValueError(f"not a demo prompt (expected 'aaa+bbb='): {prompt!r}")
    return answer_text(int(a) + int(b), len(a) + 1)


def make_problems(
    n: int, seed: int | str, exclude: set[str] | None = None, digits: int = DIGITS
) -> list[dict[str, str]]:
    """``n`` distinct problems drawn uniformly (seeded) from all ``10^(2·digits)``, skipping ``exclude``."""
    exclude = exclude or set()
    size = 10**digits
    if n < 0 or n > size * size - len(exclude):
        raise ValueError(f"cannot draw {n} distinct problems ({size * size} exist, {len(exclude)} excluded)")
    rng = random.Random(seed)  # str seeds are hashed deterministically (sha512), so runs repeat
    seen: set[int] = set()
    out = []
    while len(out) < n:
        k = rng.randrange(size * size)
        if k in seen:
            continue
        seen.add(k)
        p = problem(k // size, k % size, digits)
        if p["prompt"] not in exclude:
            out.append(p)
    return out


def split_problems(
    seed: int, n_train: int, n_eval: int, digits: int = DIGITS
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Deterministic ``(train, held_out)`` problem lists that never share a prompt.

    Each comes from its own stream, so the held-out set is the same whatever ``n_train`` is. Cut a
    development slice off ``train`` (before training) when SFT needs one (``sft_to_accuracy``).
    """
    held_out = make_problems(n_eval, f"tether-demo/{seed}/held-out", digits=digits)
    exclude = {p["prompt"] for p in held_out}
    train = make_problems(n_train, f"tether-demo/{seed}/train", exclude=exclude, digits=digits)
    return train, held_out


def gold_reward(
    prompts: list[str], responses: list[str], answer: list[Any] | None = None, **fields: Any
) -> list[float]:
    """The gold rule as a tether reward rule: 1.0 when the response text equals the answer, else 0.0.

    ``answer`` (a column of the prompt rows, one per prompt) is used when given; otherwise each answer
    is solved from its prompt. Other columns in ``fields`` are ignored. Exact match on the text only:
    ``"8610"`` is right for ``"123+045="``; ``"861"`` (unpadded), ``"0168"`` (the usual order), ``" 8610"``,
    ``"8610 "`` and ``""`` are wrong. EOS is not visible here (see the module docstring).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"gold_reward: {len(prompts)} prompts but {len(responses)} responses")
    if answer is None:
        answer = [solve(p) for p in prompts]
    elif len(answer) != len(prompts):
        raise ValueError(f"gold_reward: {len(prompts)} prompts but {len(answer)} answers")
    return [1.0 if r == str(a) else 0.0 for r, a in zip(responses, answer)]


def build_tokenizer(save_dir: str | Path | None = None, padding_side: str = "left", eos_after_text: bool = False):
    """A character-level ``PreTrainedTokenizerFast``: one token per character of ``CHARACTERS``.

    ``[PAD]`` = 0, ``[EOS]`` = 1 (also the BOS token), ``[UNK]`` = 2 for any other character. By default
    no special token is added automatically; with ``eos_after_text`` an encoding with
    ``add_special_tokens=True`` ends with ``[EOS]`` (the reward model's tokenizer: its score is read at the
    EOS that ends every reply, see ``tether.demo.pipeline``). Decoding fuses characters back without
    spaces. Left padding by default,
    which is what batched generation needs. Saved with ``save_pretrained`` when ``save_dir`` is given;
    ``AutoTokenizer.from_pretrained(save_dir)`` reloads it.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *CHARACTERS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character, newlines included ([\s\S]), is its own piece; "isolated" keeps it as a token.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    if eos_after_text:
        core.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, vocab[EOS])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=EOS,
        unk_token=UNK,
        padding_side=padding_side,
    )
    if save_dir is not None:
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def build_policy(tokenizer, seed: int, n_layer: int = 3, n_embd: int = 128, n_head: int = 4, n_positions: int = 64):
    """A randomly initialised ``GPT2LMHeadModel`` for the tokenizer (0.6M parameters at the defaults).

    Initialisation is seeded without touching the global torch RNG. Dropout is off: the PPO ratio must
    be exactly 1 on the first minibatch (B2), and the task is too small to need it. ``n_positions`` = 64
    leaves room for prompts of 8 tokens plus long, off-task responses.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model
