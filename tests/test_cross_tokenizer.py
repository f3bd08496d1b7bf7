"""Rewards across tokenizers (issue 8): a reward model with its own tokenizer scores the policy's
decoded text; a separate critic must share the policy's tokenizer, and the CLI says so."""

import subprocess
import sys
from pathlib import Path

import torch
from test_reward_model import load_rm, save_tiny_bert
from tiny import make_policy_dir, make_prompts_file, tiny_config

from tether.ppo.prompts import collate_fields
from tether.ppo.setup import setup
from tether.ppo.sources import score_responses
from tether.ppo.step import ppo_step, rollout_batch
from tether.rm.model import RewardModel

REPO = Path(__file__).resolve().parents[1]


def make_bert_rm(root: Path) -> Path:
    rm = load_rm(save_tiny_bert(root / "bert"))
    rm.set_normalization(torch.tensor([-0.3, 0.1, 0.4]))
    rm.save_pretrained(root / "bert_rm")
    return root / "bert_rm"


def test_cross_tokenizer_reward_equals_the_reward_models_own_score(tmp_path):
    policy, prompts = make_policy_dir(tmp_path), make_prompts_file(tmp_path)
    rm_dir = make_bert_rm(tmp_path)
    cfg = tiny_config(tmp_path, policy, prompts, reward__sources=[str(rm_dir)], steps=1)
    c = setup(cfg)
    rm = RewardModel.from_pretrained(rm_dir)
    assert rm.tokenizer.get_vocab() != c.models.tokenizer.get_vocab()  # really two tokenizers
    rows = c.data.prompts.next_batch()
    batch, responses = rollout_batch(c.models, cfg, rows)
    prompts_text = [r["prompt"] for r in rows]
    # The policy's tokens, decoded, then re-tokenised by the RM: the same as the RM scoring the text.
    decoded = c.models.tokenizer.batch_decode([r[m.bool()] for r, m in zip(batch.response, batch.response_mask)],
                                       skip_special_tokens=True)
    assert decoded == responses
    torch.testing.assert_close(score_responses(c.data.sources, prompts_text, responses, collate_fields(rows)),
                               rm.score(prompts_text, decoded))
    assert torch.isfinite(torch.tensor(ppo_step(c, cfg, 1)["objective/scores"]))


def test_separate_critic_with_another_tokenizer_is_refused(tmp_path):
    policy, prompts = make_policy_dir(tmp_path), make_prompts_file(tmp_path)
    rm_dir = make_bert_rm(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "tether", "ppo", "--policy", str(policy), "--prompts", str(prompts),
                           "--reward", str(rm_dir), "--critic", "separate", "--critic-model", str(rm_dir),
                           "--output-dir", str(tmp_path / "run"), "--steps", "1"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, err
    assert "must share the policy's tokenizer" in err[0]
