"""SGLang EAGLE-3 export: SpecForge-style config + ``midlayer.*`` weights, read back by the
engine's loader with identical logits; heads SGLang would compute differently are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from infer.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from train.export import export_sglang
from train.objectives.ttt import ttt_attention_mask

from .conftest import adam_steps
from .objectives.test_eagle3 import build, make_env


@pytest.fixture(scope="module")
def env(train_data):
    return make_env(train_data)


@pytest.fixture(scope="module")
def sglang_ready(env, train_data, tmp_path_factory):
    """A briefly trained head with SGLang's layer semantics, exported in both formats."""
    obj = adam_steps(build("eagle3", env, train_data, norm_before_residual=False), env[2], 5)
    root = tmp_path_factory.mktemp("export")
    spec_dir = obj.export(root / "speculators")
    return obj, spec_dir, export_sglang(spec_dir, root / "sglang")


def test_sglang_layout(sglang_ready, train_data):
    obj, _, out = sglang_ready
    cfg = json.loads((out / "config.json").read_text())
    layer = obj.drafter.config.transformer_layer_config
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == 128 and cfg["vocab_size"] == layer["vocab_size"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings"):
        assert cfg[key] == layer[key], key
    assert cfg["target_hidden_size"] == 64
    # SGLang's id j = output of layer j = our residual stream after j + 1 layers
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2],
                                   "use_aux_hidden_state": True}
    assert cfg["torch_dtype"] == "float32"
    names = set(load_file(out / "model.safetensors"))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
            "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= names
    assert not any(n.startswith("layers.") or n.startswith("embed_tokens") for n in names)
    q = load_file(out / "model.safetensors")["midlayer.self_attn.q_proj.weight"]
    assert q.shape[1] == 2 * 64  # q/k/v over cat(embeds, hidden)


def test_sglang_layout_loads_back_with_identical_logits(sglang_ready, env):
    obj, _, out = sglang_ready
    loaded = Eagle3Drafter.from_pretrained(out)
    assert loaded.config.eagle_aux_hidden_state_layer_ids == [1, 2, 3]
    assert loaded.config.norm_before_residual is False
    assert torch.equal(loaded.d2t, obj.drafter.d2t)
    loaded.share_embedding(env[1].embed_tokens)
    batch = env[2][0]
    mask = ttt_attention_mask(batch["doc_ids"], 0)
    with torch.no_grad():
        mine = obj.drafter.forward_train(batch["input_ids"], obj.drafter.prepare(batch["aux"]),
                                         batch["position_ids"], mask)
        theirs = loaded.forward_train(batch["input_ids"], loaded.prepare(batch["aux"]),
                                      batch["position_ids"], mask)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])


def test_specforge_config_without_eagle_config_uses_target_default():
    """A SpecForge config (llama3-8B-eagle3.json shape) has no eagle_config: the ids are left to
    the target (None -> default_aux_layer_ids), and SGLang's layer semantics apply."""
    cfg = Eagle3Config.from_dict({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": 128256,
        "max_position_embeddings": 2048, "tie_word_embeddings": False, "torch_dtype": "float16",
        "draft_vocab_size": 32000})
    assert cfg.eagle_aux_hidden_state_layer_ids is None and cfg.draft_vocab_size == 32000
    assert cfg.norm_before_residual is False and cfg.target_hidden == 4096
    assert cfg.layer.num_layers == 1 and cfg.vocab_size == 128256


@pytest.mark.parametrize("override,key", [
    ({}, "norm_before_residual"),  # draftsmith's default: residual = hidden_norm(g)
    ({"norm_before_residual": False, "norm_output": True}, "norm_output"),
    ({"norm_before_residual": False, "embed_requires_grad": True}, "embed_requires_grad"),
    ({"norm_before_residual": False, "aux_layer_ids": [0, 2, 4]},
     "eagle_aux_hidden_state_layer_ids"),
    ({"norm_before_residual": False, "aux_layer_ids": [1, 3]}, "eagle_aux_hidden_state_layer_ids"),
])
def test_heads_sglang_would_run_differently_are_refused(env, train_data, tmp_path, override,
                                                        key):
    spec_dir = build("eagle3", env, train_data, **override).export(tmp_path / "head")
    with pytest.raises(ValueError, match=f"export_sglang.*{key!r}"):
        export_sglang(spec_dir, tmp_path / "sglang")
    assert not (tmp_path / "sglang").exists()


# ---- vLLM versions ------------------------------------------------------------------------------

@pytest.mark.parametrize("override, version, feature", [
    ({"norm_before_fc": True}, "0.19.0", "norm_before_fc=true"),
    ({"fc_norm": True}, "0.25.0", "fc_norm=true"),
    ({"norm_output": True, "norm_before_fc": True}, "0.25.0", "norm_output=true"),
    ({"embed_requires_grad": True}, "0.11.1",
     "embed_requires_grad=true (embed_tokens.weight shipped)"),
    ({"aux_layer_ids": [1, 2, 4]}, "0.18.0", "aux id 0 (embeddings) or n (last layer)"),
    ({"aux_layer_ids": [1, 3]}, "0.22.0", "2 aux states (num_aux_hidden_states)"),
])
def test_vllm_requirements_name_the_feature_and_version(env, train_data, override, version,
                                                        feature):
    from train.export import vllm_report

    obj = build("eagle3", env, train_data, **override)
    report = obj.serving_notes()
    assert report == vllm_report(obj.drafter.config, 4)
    head, *lines = report.splitlines()
    assert head == f"vLLM: this head needs vLLM >= {version}"
    assert any(line.strip().startswith(f"{feature}: needs vLLM >= {version}; older vLLM ")
               for line in lines), report


def test_default_head_needs_only_speculators_support(env, train_data, tmp_path, capsys):
    from train.export import main

    obj = build("eagle3", env, train_data)  # the 4-layer target's default ids [1, 2, 3]
    assert obj.serving_notes() == "vLLM: this head needs vLLM >= 0.10.1"
    main(["--vllm", str(obj.export(tmp_path / "head"))])  # no target layer count: ids explicit
    assert capsys.readouterr().out.splitlines() == [
        "vLLM: this head needs vLLM >= 0.11.1",
        "  eagle_aux_hidden_state_layer_ids=[1, 2, 3]: needs vLLM >= 0.11.1; older vLLM "
        "captures its default layers [2, n // 2, n - 3]"]


def test_two_aux_states_tell_vllm_their_count(env, train_data, tmp_path):
    """vLLM's Llama EAGLE-3 drafter sizes fc from num_aux_hidden_states, not from the ids."""
    two = json.loads((build("eagle3", env, train_data, aux_layer_ids=[1, 3]).export(
        tmp_path / "two") / "config.json").read_text())
    assert two["transformer_layer_config"]["num_aux_hidden_states"] == 2
    three = json.loads((build("eagle3", env, train_data).export(
        tmp_path / "three") / "config.json").read_text())
    assert "num_aux_hidden_states" not in three["transformer_layer_config"]
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "two")
    assert loaded.fc.in_features == 2 * loaded.config.target_hidden


def test_peagle_head_needs_parallel_drafting_support(env, train_data, tmp_path, capsys):
    """A P-EAGLE head's minimum is vLLM's parallel drafting for EAGLE heads, said once, both
    before training and by ``--vllm`` on its export."""
    from train.export import main

    obj = build("peagle", env, train_data, parallel_depths=2)
    head, *lines = obj.serving_notes().splitlines()
    assert head == "vLLM: this head needs vLLM >= 0.16.0"
    assert sum("0.16.0" in line for line in lines) == 1
    main(["--vllm", str(obj.export(tmp_path / "head"))])
    assert capsys.readouterr().out.splitlines()[0] == head
