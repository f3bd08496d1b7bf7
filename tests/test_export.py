"""The final policy export (issue 30): weights in ``--model-dtype`` (a bf16 run writes bf16, its fp32 masters stay in
the checkpoints) and ``--export-lora adapter`` (the adapter alone, loadable with peft over the base, computing what
the trained policy and the merged export compute)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny import make_policy_dir, make_prompts_file, tiny_config

import tether
from tether.errors import ConfigError
from tether.ppo.export import export_policy


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    return make_policy_dir(root), make_prompts_file(root)


def test_a_bf16_run_exports_bf16_weights_rounded_from_the_checkpoints_fp32_masters(files, tmp_path):
    from transformers import AutoModelForCausalLM

    run = tether.PPOTrainer(tiny_config(tmp_path, *files, steps=1, model__dtype="bf16")).train().run_dir
    exported = load_file(str(run / "policy" / "model.safetensors"))
    masters = load_file(str(run / "checkpoints" / "step_000001" / "policy" / "model.safetensors"))
    assert {w.dtype for w in masters.values()} == {torch.float32}
    assert {w.dtype for w in exported.values()} == {torch.bfloat16} and exported.keys() == masters.keys()
    assert all(torch.equal(exported[k], masters[k].to(torch.bfloat16)) for k in exported)
    assert json.loads((run / "policy" / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(run / "policy")
    assert model.dtype == torch.bfloat16


def test_a_lora_adapter_export_loads_with_peft_and_computes_the_merged_policy(files, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy, prompts = files
    trainer = tether.PPOTrainer(tiny_config(tmp_path, policy, prompts, steps=1, model__lora_r=4,
                                            model__export_lora="adapter"))
    run = trainer.train().run_dir
    assert sorted(p.name for p in (run / "policy").glob("*.safetensors")) == ["adapter_model.safetensors"]
    adapter = load_file(str(run / "policy" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(policy), run / "policy").eval()
    merged_dir = export_policy(trainer.run, tmp_path / "merged", "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    trained = trainer.run.models.unwrapped_policy.eval()
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        assert not torch.allclose(want, AutoModelForCausalLM.from_pretrained(policy)(input_ids=ids).logits)
        assert torch.allclose(loaded(input_ids=ids).logits, want, atol=1e-5)
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-5)
    with pytest.raises(ConfigError, match="--export-lora adapter: needs --lora-r > 0"):
        cfg = tiny_config(tmp_path / "full", policy, prompts)
        cfg.model.export_lora = "adapter"
        tether.PPOTrainer(cfg)
