"""EAGLE-3 drafter: speculators config.json, weight names, vocab mapping, cached == full forward."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.drafters.common import StepKV, restrict_vocab
from infer.drafters.eagle3 import Eagle3Config, Eagle3Drafter, default_aux_layer_ids
from infer.kv_cache import KVCache
from infer.models.attention import packed_causal_mask
from infer.models.llama import Llama, ModelConfig, inference_layout

TARGET = ModelConfig(vocab_size=64, hidden_size=48, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=8, intermediate_size=64)
LAYER_KEYS = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
              "mlp.down_proj.weight", "input_layernorm.weight", "hidden_norm.weight",
              "post_attention_layernorm.weight"}
BASE_NAMES = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    f"layers.0.{k}" for k in LAYER_KEYS}


def make_config(draft_hidden=32, draft_vocab=20, **flags):
    """Draft layer narrower than the target (32 vs 48) so fc's 3 * H_target is visible."""
    cfg = Eagle3Config.for_target(TARGET, draft_vocab_size=draft_vocab, speculative_tokens=4,
                                  verifier_name_or_path="org/tiny-target", **flags)
    cfg.transformer_layer_config.update(hidden_size=draft_hidden, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=8)
    return cfg


def make_drafter(seed=0, with_embedding=True, **flags):
    torch.manual_seed(seed)
    d = Eagle3Drafter(make_config(**flags), with_embedding=with_embedding)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 0.1)
            if p.ndim == 1:
                p.add_(1.0)
    gen = torch.Generator().manual_seed(seed)
    d.set_vocab(torch.randperm(64, generator=gen)[:20].sort().values)
    return d.eval()


def inputs(b=2, t=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (b, t), generator=g), torch.randn(b, t, 3 * 48, generator=g)


# ---- config.json ---------------------------------------------------------------------------------

def test_config_json_has_every_speculators_key(tmp_path):
    make_drafter().save_pretrained(tmp_path / "head")
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DraftModel"]
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["draft_vocab_size"] == 20
    assert cfg["target_hidden_size"] == 48
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    for key, value in [("norm_before_fc", False), ("norm_before_residual", True),
                       ("norm_output", False), ("fc_norm", False), ("embed_requires_grad", False),
                       ("tie_word_embeddings", False)]:
        assert cfg[key] is value, key
    layer = cfg["transformer_layer_config"]
    assert layer["vocab_size"] == 64 and layer["hidden_size"] == 32
    assert layer["num_hidden_layers"] == 1 and layer["model_type"] == "llama"
    assert {"num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
            "rope_theta", "rms_norm_eps"} <= set(layer)
    assert cfg["speculators_config"] == {
        "algorithm": "eagle3", "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4,
                              "accept_tolerance": 0.0, "verifier_accept_k": 1}],
        "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "org/tiny-target"}}
    assert isinstance(cfg["speculators_version"], str)


def test_config_round_trip_and_vllm_defaults():
    cfg = make_config(norm_before_fc=True, fc_norm=True, norm_output=True)
    cfg.extra = {"auto_map": {"": "x"}}
    again = Eagle3Config.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.to_dict() == cfg.to_dict()
    minimal = {k: v for k, v in cfg.to_dict().items()
               if k not in ("norm_before_residual", "draft_vocab_size")}
    parsed = Eagle3Config.from_dict(minimal)
    assert parsed.norm_before_residual is True  # vLLM's default when the key is absent
    assert parsed.draft_vocab_size == 64  # absent -> the target vocabulary


@pytest.mark.parametrize("change, key", [
    ({"speculators_model_type": "eagle"}, "speculators_model_type"),
    ({"draft_vocab_size": 65}, "draft_vocab_size"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}, "eagle_aux_hidden_state_layer_ids"),
    ({"transformer_layer_config": {"num_hidden_layers": 0, "vocab_size": 64}},
     "num_hidden_layers"),
])
def test_config_errors_name_the_key(change, key):
    with pytest.raises(ValueError, match=key):
        Eagle3Config.from_dict({**make_config().to_dict(), **change})


@pytest.mark.parametrize("n, ids", [(4, [1, 2, 3]), (5, [1, 2, 4]), (6, [2, 3, 5]),
                                    (7, [2, 3, 4]), (32, [2, 16, 29]), (80, [2, 40, 77])])
def test_default_aux_layer_ids(n, ids):
    assert default_aux_layer_ids(n) == ids


@pytest.mark.parametrize("n", [2, 3, 0])
def test_default_aux_layer_ids_too_few_layers(n):
    with pytest.raises(ValueError, match="num_target_layers.*>= 4"):
        default_aux_layer_ids(n)


# ---- weights -------------------------------------------------------------------------------------

def assert_same_outputs(d: Eagle3Drafter, loaded: Eagle3Drafter) -> None:
    """The reloaded head computes exactly what the saved one did (logits and hidden)."""
    ids, aux = inputs()
    with torch.no_grad():
        want = d.forward_train(ids, d.prepare(aux))
        got = loaded.forward_train(ids, loaded.prepare(aux))
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


@pytest.mark.parametrize("flags, extra_names", [
    ({}, set()),
    ({"norm_before_fc": True}, {"input_norm.weight"}),
    ({"fc_norm": True}, {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}),
])
def test_weight_names_and_save_load_identity(tmp_path, flags, extra_names):
    d = make_drafter(**flags)
    d.save_pretrained(tmp_path / "head")
    names = set(load_file(tmp_path / "head" / "model.safetensors"))
    assert names == BASE_NAMES | {"embed_tokens.weight"} | extra_names
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "head")
    assert_same_outputs(d, loaded)
    assert not any(p.requires_grad for p in loaded.parameters())


def test_shapes_follow_the_spec():
    d = make_drafter()
    attn = d.layers[0].self_attn
    assert attn.q_proj.in_features == attn.k_proj.in_features == attn.v_proj.in_features == 64
    assert d.fc.in_features == 3 * 48 and d.fc.out_features == 32 and d.fc.bias is None
    assert d.lm_head.out_features == 20
    assert d.d2t.dtype == torch.int64 and d.d2t.shape == (20,)
    assert d.t2d.dtype == torch.bool and d.t2d.shape == (64,)


def test_without_embedding_shares_the_targets(tmp_path):
    d = make_drafter(with_embedding=False)
    ids, aux = inputs()
    with pytest.raises(RuntimeError, match="share_embedding"):
        d.forward_train(ids, d.prepare(aux))
    d.save_pretrained(tmp_path / "head")
    assert "embed_tokens.weight" not in load_file(tmp_path / "head" / "model.safetensors")
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "head")
    assert loaded.embed_tokens is None
    emb = torch.nn.Embedding(64, 32)
    d.share_embedding(emb)
    loaded.share_embedding(emb)
    with torch.no_grad():
        assert torch.equal(d.forward_train(ids, d.prepare(aux))[0],
                           loaded.forward_train(ids, loaded.prepare(aux))[0])


def test_foreign_names_and_missing_vocab_buffers(tmp_path):
    d = make_drafter()
    d.save_pretrained(tmp_path / "head")
    path = tmp_path / "head" / "model.safetensors"
    state = load_file(path)
    sglang = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
              for k, v in state.items() if k not in ("d2t", "t2d")}
    sglang["verifier_lm_head.weight"] = torch.zeros(20, 32)
    save_file(sglang, str(path))
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "head")
    assert torch.equal(loaded.d2t, torch.zeros(20, dtype=torch.long))  # identity default
    assert loaded.t2d[:20].all() and not loaded.t2d[20:].any()
    save_file({**state, "extra.weight": torch.zeros(1)}, str(path))
    with pytest.raises(ValueError, match="unexpected weights.*extra.weight"):
        Eagle3Drafter.from_pretrained(tmp_path / "head")


def test_vocab_mapping():
    d = make_drafter()
    chosen = torch.tensor([1, 3, 4, 8, 9, 10, 15, 20, 21, 22, 30, 31, 40, 41, 50, 55, 60, 61, 62,
                           63])
    d.set_vocab(chosen)
    assert torch.equal(d.to_target_ids(torch.arange(20)), chosen)
    assert torch.equal(torch.nonzero(d.t2d).flatten(), chosen)
    q = torch.softmax(torch.randn(2, 3, 20), dim=-1)
    full = d.to_target_probs(q)  # [2, 3, 64]
    assert torch.allclose(full.sum(-1), torch.ones(2, 3))
    assert torch.equal(full[..., chosen], q) and not full[..., ~d.t2d].any()
    with pytest.raises(ValueError, match="distinct target ids"):
        d.set_vocab(torch.zeros(20, dtype=torch.long))


def test_restrict_vocab_keeps_the_map_tokens_rows_and_mapping():
    """A token map's tokens in the draft vocabulary stay (ids outside it are ignored): their LM
    head rows, their d2t / t2d; the restricted head's logits are the full head's at those
    tokens, so its argmax is the full head's argmax among them."""
    d = make_drafter()
    ids, aux = inputs(b=2, t=5)
    with torch.no_grad():
        full, _ = d.forward_train(ids, d.prepare(aux))  # [2, 5, 20]
        drafts = d.to_target_ids(torch.arange(20))  # [20] target ids, ascending
        chosen = drafts[torch.tensor([0, 3, 4, 11, 19])]
        outside = torch.tensor(sorted(set(range(64)) - set(drafts.tolist()))[:3])
        assert restrict_vocab(d, torch.cat([outside, chosen.flip(0)])) == 5
        part, _ = d.forward_train(ids, d.prepare(aux))  # [2, 5, 5]
    assert d.lm_head.weight.shape == (5, 32)
    assert torch.equal(d.to_target_ids(torch.arange(5)), chosen)
    assert torch.equal(torch.nonzero(d.t2d).flatten(), chosen)
    keep = torch.tensor([0, 3, 4, 11, 19])
    assert torch.allclose(part, full[..., keep], atol=1e-6)
    assert torch.equal(d.to_target_ids(part.argmax(-1)), drafts[keep][full[..., keep].argmax(-1)])
    with pytest.raises(ValueError, match="none of its tokens"):
        restrict_vocab(d, outside)


# ---- forwards ------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [{}, {"norm_before_residual": False}, {"norm_output": True},
                                   {"norm_before_fc": True, "fc_norm": True}])
def test_cached_forward_equals_full_sequence(flags):
    d = make_drafter(**flags)
    ids, aux = inputs(b=3, t=9)
    with torch.no_grad():
        g = d.prepare(aux)
        full_logits, full_hidden = d.forward_train(ids, g)
        cache = KVCache.for_model(d.layer_config, 4, 16)
        slots = torch.tensor([2, 0, 3])
        steps = [d(ids[:, t:t + 1], g[:, t:t + 1], cache, slots) for t in range(9)]
    assert torch.allclose(torch.cat([s[0] for s in steps], 1), full_logits, atol=1e-4, rtol=1e-4)
    assert torch.allclose(torch.cat([s[1] for s in steps], 1), full_hidden, atol=1e-4, rtol=1e-4)


def test_one_row_steps_in_the_inference_layout_equal_full_sequence():
    """How proposers serve a head: fused and (on CPU) packed projections, one pair per step of
    a single row (no mask)."""
    d = make_drafter()
    ids, aux = inputs(b=1, t=7)
    with torch.no_grad():
        g = d.prepare(aux)
        full_logits, full_hidden = d.forward_train(ids, g)
        inference_layout(d)
        assert d.layers[0].self_attn._qkv.active() and d.layers[0].mlp._gate_up.active()
        cache = KVCache.for_model(d.layer_config, 2, 16)
        steps = [d(ids[:, t:t + 1], g[:, t:t + 1], cache, torch.tensor([1])) for t in range(7)]
    assert torch.allclose(torch.cat([s[0] for s in steps], 1), full_logits, atol=1e-4, rtol=1e-4)
    assert torch.allclose(torch.cat([s[1] for s in steps], 1), full_hidden, atol=1e-4, rtol=1e-4)


def _one_pair_steps(d, ids, g, *, modules=False):
    """Cached one-pair steps of one row: bundles with gradients off, the modules with them on
    (nothing to record: the head is frozen)."""
    cache = KVCache.for_model(d.layer_config, 1, 16)
    with torch.set_grad_enabled(modules):
        steps = [d(ids[:, t:t + 1], g[:, t:t + 1], cache) for t in range(ids.shape[1])]
    return torch.cat([s[0] for s in steps], 1), torch.cat([s[1] for s in steps], 1)


@pytest.mark.parametrize("norm_output", [False, True])
def test_cached_steps_run_bundles_equal_to_the_modules_and_see_a_new_shared_embedding(
        norm_output):
    d = make_drafter(with_embedding=False, draft_hidden=48, norm_output=norm_output)
    d.requires_grad_(False)
    target = Llama(TARGET).requires_grad_(False)
    d.share_embedding(target.embed_tokens)
    inference_layout(d)
    ids, aux = inputs(b=1, t=6)
    with torch.no_grad():
        g = d.prepare(aux)
    want = _one_pair_steps(d, ids, g, modules=True)
    got = _one_pair_steps(d, ids, g)
    assert "_weight_snapshot" in d.__dict__
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    target.load_state_dict({"embed_tokens.weight": torch.randn(64, 48)}, strict=False,
                           assign=True)  # the shared table replaced under the head
    want = _one_pair_steps(d, ids, g, modules=True)
    assert not torch.equal(want[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(_one_pair_steps(d, ids, g), want))


def test_norm_output_feeds_back_the_normed_state():
    plain, normed = make_drafter(), make_drafter(norm_output=True)  # same seed: same weights
    ids, aux = inputs()
    with torch.no_grad():
        logits0, h0 = plain.forward_train(ids, plain.prepare(aux))
        logits1, h1 = normed.forward_train(ids, normed.prepare(aux))
    assert torch.equal(logits0, logits1) and torch.allclose(h1, plain.norm(h0))


def test_ragged_catch_up_and_rollback_match_full_sequence():
    d = make_drafter()
    ids, aux = inputs(b=2, t=8)
    with torch.no_grad():
        g = d.prepare(aux)
        full = d.forward_train(ids, g)[0]  # [2, 8, 20]
        cache = KVCache.for_model(d.layer_config, 2, 16)
        d(ids[:, :5], g[:, :5], cache, num_tokens=torch.tensor([5, 3]))  # ragged prefix
        d(torch.zeros(2, 2, dtype=torch.long), torch.randn(2, 2, 32), cache)  # junk drafts
        cache.truncate(torch.arange(2), torch.tensor([5, 3]))  # roll the junk back
        rest0 = d(ids[:1, 5:], g[:1, 5:], cache, torch.tensor([0]))[0]
        rest1 = d(ids[1:, 3:], g[1:, 3:], cache, torch.tensor([1]),
                  logits_at=torch.tensor([[4]]))[0]
    assert torch.allclose(rest0, full[:1, 5:], atol=1e-4, rtol=1e-4)
    assert torch.allclose(rest1[0, 0], full[1, 7], atol=1e-4, rtol=1e-4)


def test_forward_train_with_step_kv_and_mask_matches_full():
    """The TTT entry point: keys of earlier calls + an explicit mask (here plain causal)."""
    d = make_drafter()
    ids, aux = inputs(b=2, t=7)
    with torch.no_grad():
        g = d.prepare(aux)
        full = d.forward_train(ids, g)[0]
        kv = StepKV()
        first = d.forward_train(ids[:, :4], g[:, :4], attention_mask=torch.ones(
            2, 4, 4, dtype=torch.bool).tril(), kv=kv)[0]
        mask = torch.ones(7, 7, dtype=torch.bool).tril()[4:].expand(2, 3, 7)
        second = d.forward_train(ids[:, 4:], g[:, 4:], torch.arange(4, 7).expand(2, 3), mask,
                                 kv=kv)[0]
        assert kv.length == 7
        with pytest.raises(ValueError, match="attention_mask"):
            d.forward_train(ids[:, :1], g[:, :1], kv=kv)
        packed = d.forward_train(ids, g, attention_mask=packed_causal_mask(
            torch.zeros(2, 7, dtype=torch.long)))[0]
    assert torch.allclose(torch.cat([first, second], 1), full, atol=1e-4, rtol=1e-4)
    assert torch.allclose(packed, full, atol=1e-4, rtol=1e-4)


def test_prepare_consumes_target_aux_states_in_sorted_order():
    """fc sees cat(aux) in sorted id order: the Llama forward returns them in the order asked."""
    torch.manual_seed(0)
    target = Llama(TARGET).eval()
    d = make_drafter()
    ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        out = target.forward_train(ids, aux_layer_ids=d.aux_layer_ids)
        assert len(out.aux) == 3 and out.aux[0].shape == (1, 5, 48)
        assert d.prepare(torch.cat(out.aux, -1)).shape == (1, 5, 32)


def test_draft_layer_is_llama_for_any_target_family():
    qwen3 = ModelConfig(**{**TARGET.__dict__, "model_type": "qwen3", "qk_norm": True,
                           "o_bias": True, "qkv_bias": True, "architecture": "Qwen3ForCausalLM"})
    cfg = Eagle3Config.for_target(qwen3)
    layer = cfg.transformer_layer_config
    assert (layer["model_type"], layer["architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert not cfg.layer.qk_norm and not cfg.layer.qkv_bias
    assert cfg.verifier_architectures == ["Qwen3ForCausalLM"]


def test_save_over_an_existing_checkpoint_is_clean(tmp_path):
    make_drafter(seed=0).save_pretrained(tmp_path / "head")
    second = make_drafter(seed=1)
    second.save_pretrained(tmp_path / "head")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]  # no temp dirs left
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == ["config.json",
                                                                    "model.safetensors"]
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "head")
    assert torch.equal(loaded.fc.weight, second.fc.weight)


# ---- more than one decoder layer (vLLM's Eagle3LlamaForCausalLM with num_hidden_layers = N) ----

PLAIN_KEYS = LAYER_KEYS - {"hidden_norm.weight"}


def test_two_layer_head_names_shapes_and_round_trip(tmp_path):
    """Layer 0 is the EAGLE-3 layer (2H q/k/v, hidden_norm), layer 1 a plain Llama layer (H
    q/k/v, no hidden_norm: vLLM builds one but never reads it); save -> load is identical."""
    d = make_drafter(num_layers=2)
    assert d.config.num_layers == 2 and d.layer_config.num_layers == 2
    assert d.layers[0].self_attn.q_proj.in_features == 64
    assert d.layers[1].self_attn.q_proj.in_features == 32
    d.save_pretrained(tmp_path / "head")
    names = set(load_file(tmp_path / "head" / "model.safetensors"))
    assert names == BASE_NAMES | {"embed_tokens.weight"} | {f"layers.1.{k}" for k in PLAIN_KEYS}
    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    assert raw["transformer_layer_config"]["num_hidden_layers"] == 2
    assert Eagle3Config.from_dict(raw).to_dict() == {**d.config.to_dict(),
                                                     "torch_dtype": "float32"}
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "head")
    assert_same_outputs(d, loaded)


def test_unused_hidden_norm_of_later_layers_is_dropped_on_load(tmp_path):
    """An exporter that ships vLLM's unused ``layers.1.hidden_norm.weight`` still loads."""
    d = make_drafter(num_layers=2)
    d.save_pretrained(tmp_path / "head")
    weights = tmp_path / "head" / "model.safetensors"
    state = load_file(weights)
    state["layers.1.hidden_norm.weight"] = torch.ones(32)
    save_file(state, str(weights))
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "head")
    assert torch.equal(loaded.layers[1].mlp.down_proj.weight, d.layers[1].mlp.down_proj.weight)


@pytest.mark.parametrize("flags", [{}, {"norm_before_residual": False, "norm_output": True}])
def test_two_layer_cached_and_step_kv_forwards_equal_full(flags):
    """Per-layer KV: the cache holds both layers, TTT's StepKV keys them by layer index."""
    d = make_drafter(num_layers=2, **flags)
    ids, aux = inputs(b=2, t=7)
    with torch.no_grad():
        g = d.prepare(aux)
        full_logits, full_hidden = d.forward_train(ids, g)
        cache = KVCache.for_model(d.layer_config, 3, 16)
        assert cache.k.shape[0] == 2
        steps = [d(ids[:, t:t + 1], g[:, t:t + 1], cache, torch.tensor([2, 0]))
                 for t in range(7)]
        kv = StepKV()
        first = d.forward_train(ids[:, :4], g[:, :4], attention_mask=torch.ones(
            2, 4, 4, dtype=torch.bool).tril(), kv=kv)[0]
        mask = torch.ones(7, 7, dtype=torch.bool).tril()[4:].expand(2, 3, 7)
        second = d.forward_train(ids[:, 4:], g[:, 4:], torch.arange(4, 7).expand(2, 3), mask,
                                 kv=kv)[0]
        assert sorted(kv.k) == [0, 1]
        inference_layout(d)
        cache = KVCache.for_model(d.layer_config, 1, 16)
        fused = [d(ids[:1, t:t + 1], g[:1, t:t + 1], cache, torch.tensor([0])) for t in range(7)]
    close = dict(atol=1e-4, rtol=1e-4)
    assert torch.allclose(torch.cat([s[0] for s in steps], 1), full_logits, **close)
    assert torch.allclose(torch.cat([s[1] for s in steps], 1), full_hidden, **close)
    assert torch.allclose(torch.cat([first, second], 1), full_logits, **close)
    assert torch.allclose(torch.cat([s[0] for s in fused], 1), full_logits[:1], **close)
