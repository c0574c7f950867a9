"""EAGLE-1 head: vLLM EAGLEConfig config.json, weight names, shared target head, cached == full."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.drafters.common import StepKV
from infer.drafters.eagle import EagleConfig, EagleDrafter
from infer.kv_cache import KVCache
from infer.models.llama import Llama, ModelConfig, inference_layout

TARGET = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, intermediate_size=48)
NAMES = {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
         "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
         "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
         "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight"}


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Llama(TARGET).eval()


def make_head(target, fc_bias=False, seed=0):
    torch.manual_seed(seed)
    head = EagleDrafter(EagleConfig.for_target(TARGET, fc_bias=fc_bias))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 0.1)
    head.attach_target(target)
    return head.eval()


def inputs(b=2, t=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (b, t), generator=g), torch.randn(b, t, 32, generator=g)


def test_config_json_is_vllms_eagle_config(tmp_path, target):
    make_head(target).save_pretrained(tmp_path / "head")
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["model_type"] == "eagle"
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"]
    assert cfg["bias"] is False
    model = cfg["model"]
    assert model["architectures"] == ["LlamaForCausalLM"] and model["model_type"] == "llama"
    assert (model["num_hidden_layers"], model["hidden_size"], model["vocab_size"]) == (1, 32, 64)
    again = EagleConfig.from_dict(cfg)
    assert again.to_dict() == cfg


def test_plain_llama_config_and_family_bias_defaults():
    plain = {**EagleConfig.for_target(TARGET).model, "bias": True}  # original EAGLE releases
    cfg = EagleConfig.from_dict(plain)
    assert cfg.fc_bias is True and cfg.layer.hidden_size == 32 and "bias" not in cfg.model
    assert EagleConfig.for_target(TARGET).fc_bias is False  # vLLM's Llama EAGLE: no fc bias
    qwen2 = ModelConfig(**{**TARGET.__dict__, "model_type": "qwen2", "qkv_bias": True,
                           "architecture": "Qwen2ForCausalLM"})
    assert EagleConfig.for_target(qwen2).fc_bias is True  # vLLM's Qwen2 EAGLE: with bias
    with pytest.raises(ValueError, match="num_hidden_layers"):
        EagleConfig.from_dict({"model_type": "eagle", "model": {**plain, "num_hidden_layers": 2}})


@pytest.mark.parametrize("fc_bias", [False, True])
def test_weight_names_and_save_load_identity(tmp_path, target, fc_bias):
    head = make_head(target, fc_bias=fc_bias)
    head.save_pretrained(tmp_path / "head")
    names = set(load_file(tmp_path / "head" / "model.safetensors"))
    assert names == NAMES | ({"fc.bias"} if fc_bias else set())
    loaded = EagleDrafter.from_pretrained(tmp_path / "head")
    assert loaded.config.fc_bias is fc_bias
    loaded.attach_target(target)
    ids, feats = inputs()
    with torch.no_grad():
        want, got = head.forward_train(ids, feats), loaded.forward_train(ids, feats)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_load_ignores_embedding_and_model_prefix_weights_decide_bias(tmp_path, target):
    head = make_head(target, fc_bias=True)
    head.save_pretrained(tmp_path / "head")
    path = tmp_path / "head" / "model.safetensors"
    state = {f"model.{k}": v for k, v in load_file(path).items() if k != "fc.bias"}
    state["embed_tokens.weight"] = torch.zeros(64, 32)  # original EAGLE ships a copy
    save_file(state, str(path))
    loaded = EagleDrafter.from_pretrained(tmp_path / "head")  # config says bias, weights don't
    assert loaded.fc.bias is None and loaded.config.fc_bias is False
    save_file({**state, "norm.weight": torch.ones(32)}, str(path))
    with pytest.raises(ValueError, match="unexpected weights.*norm.weight"):
        EagleDrafter.from_pretrained(tmp_path / "head")


def test_architecture_matches_eagle(target):
    head = make_head(target)
    assert head.fc.in_features == 2 * 32 and head.fc.out_features == 32
    assert isinstance(head.layers[0].input_layernorm, torch.nn.Identity)
    assert head.aux_layer_ids == ()
    ids, feats = inputs()
    with torch.no_grad():
        logits, hidden = head.forward_train(ids, feats)
        assert torch.equal(logits, target.lm_head(hidden))  # the target's head, no final norm
        swapped = head.fc(torch.cat([feats, target.embed_tokens(ids)], -1))
        ordered = head.fc(torch.cat([target.embed_tokens(ids), feats], -1))
        assert not torch.allclose(swapped, ordered)  # order matters: embedding first
    assert "embed_tokens.weight" not in head.state_dict()
    assert "lm_head.weight" not in head.state_dict()


def test_needs_a_matching_target(target):
    head = EagleDrafter(EagleConfig.for_target(TARGET))
    ids, feats = inputs()
    with pytest.raises(RuntimeError, match="attach_target"):
        head.forward_train(ids, feats)
    other = Llama(ModelConfig(**{**TARGET.__dict__, "vocab_size": 65}))
    with pytest.raises(ValueError, match="vocab_size 64"):
        head.attach_target(other)


def test_cached_forward_equals_full_sequence(target):
    head = make_head(target)
    ids, feats = inputs(b=2, t=8)
    with torch.no_grad():
        full_logits, full_hidden = head.forward_train(ids, feats)
        cache = KVCache.for_model(head.layer_config, 2, 16)
        first = head(ids[:, :5], feats[:, :5], cache, num_tokens=torch.tensor([5, 3]))
        cache.truncate(torch.arange(2), torch.tensor([5, 3]))
        rest0 = head(ids[:1, 5:], feats[:1, 5:], cache, torch.tensor([0]))
        steps1 = [head(ids[1:, t:t + 1], feats[1:, t:t + 1], cache, torch.tensor([1]))
                  for t in range(3, 8)]
        kv = StepKV()
        a = head.forward_train(ids[:, :3], feats[:, :3], kv=kv)[0]
        b = head.forward_train(ids[:, 3:], feats[:, 3:], torch.arange(3, 8).expand(2, 5),
                               torch.ones(8, 8, dtype=torch.bool).tril()[3:].expand(2, 5, 8),
                               kv=kv)[0]
    close = dict(atol=1e-4, rtol=1e-4)
    assert torch.allclose(first[0][0], full_logits[0, :5], **close)
    assert torch.allclose(first[0][1, :3], full_logits[1, :3], **close)
    assert torch.allclose(rest0[0], full_logits[:1, 5:], **close)
    assert torch.allclose(rest0[1], full_hidden[:1, 5:], **close)
    assert torch.allclose(torch.cat([s[0] for s in steps1], 1), full_logits[1:, 3:], **close)
    assert torch.allclose(torch.cat([a, b], 1), full_logits, **close)


def _one_pair_steps(head, ids, hidden, *, modules=False):
    """Cached one-pair steps of one row: bundles with gradients off, the modules with them on
    (nothing to record: everything is frozen)."""
    cache = KVCache.for_model(head.layer_config, 1, 16)
    with torch.set_grad_enabled(modules):
        steps = [head(ids[:, t:t + 1], hidden[:, t:t + 1], cache) for t in range(ids.shape[1])]
    return torch.cat([s[0] for s in steps], 1), torch.cat([s[1] for s in steps], 1)


def test_cached_steps_run_bundles_equal_to_the_modules_and_see_a_new_shared_lm_head():
    torch.manual_seed(0)
    target = Llama(TARGET).requires_grad_(False).eval()
    head = inference_layout(make_head(target, fc_bias=True).requires_grad_(False))
    ids, hidden = inputs(b=1, t=6)
    want = _one_pair_steps(head, ids, hidden, modules=True)
    got = _one_pair_steps(head, ids, hidden)
    assert "_weight_snapshot" in head.__dict__
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    target.lm_head.weight = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
    want = _one_pair_steps(head, ids, hidden, modules=True)
    assert not torch.equal(want[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(_one_pair_steps(head, ids, hidden), want))
