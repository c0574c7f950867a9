"""What every objective shares (train/objectives/base.py): the target's last layer a head
starts from."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Phi3Config, Phi3ForCausalLM

from infer.foundation.errors import ConfigError
from infer.models.foreign import target_config
from train.objectives.base import last_layer_state

from ..conftest import save_train_target


def test_a_fused_phi3_layer_is_read_as_its_parts(tmp_path):
    """Phi-3 stores q/k/v and gate/up fused; the head copies them as the engine's parts."""
    torch.manual_seed(0)
    cfg = Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    Phi3ForCausalLM(cfg).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    layer, norm = last_layer_state(tmp_path, target_config(tmp_path), "drafter=mtp")
    qkv = model.model.layers[1].self_attn.qkv_proj.weight  # [(4 + 2 + 2) * 8, 32]
    gate_up = model.model.layers[1].mlp.gate_up_proj.weight  # [2 * 48, 32]
    assert torch.equal(layer["self_attn.q_proj.weight"], qkv[:32])
    assert torch.equal(layer["self_attn.k_proj.weight"], qkv[32:48])
    assert torch.equal(layer["self_attn.v_proj.weight"], qkv[48:])
    assert torch.equal(layer["mlp.gate_proj.weight"], gate_up[:48])
    assert torch.equal(layer["mlp.up_proj.weight"], gate_up[48:])
    assert torch.equal(norm, model.model.norm.weight)
    assert "self_attn.qkv_proj.weight" not in layer


def test_a_target_the_engine_does_not_run_is_refused_by_the_setting(tmp_path):
    path = save_train_target(tmp_path / "gemma3", arch="gemma3")
    with pytest.raises(ConfigError, match="drafter.layer_from_target.*Gemma3ForCausalLM"):
        last_layer_state(path, target_config(path), "drafter.layer_from_target")
