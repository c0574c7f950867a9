"""MLP speculator (docs/reference.md §5): stage weights, vLLM config.json and tensor names,
save/load round trip, tied weights, teacher-forced vs chained forwards."""

import json
import math

import pytest
import torch
from safetensors import safe_open

from infer.drafters.mlp_speculator import (MLPSpeculator, MLPSpeculatorConfig,
                                           MLPSpeculatorLayerNorm)

V, E, D = 40, 16, 24


def _cfg(**kw):
    kw.setdefault("n_predict", 3)
    kw.setdefault("top_k_tokens_per_head", [4, 3, 2, 2][: kw["n_predict"]])
    return MLPSpeculatorConfig(emb_dim=E, vocab_size=V, inner_dim=D, **kw)


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    m = MLPSpeculator(_cfg(**kw))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def test_stage_weights_match_formula():
    for n in (1, 3, 4):
        m = MLPSpeculator(_cfg(n_predict=n))
        sw = 0.5 ** (0.5 / n)
        assert m.state_weight == pytest.approx(sw)
        assert m.emb_weight == pytest.approx(math.sqrt((1 - sw ** 2) * D / 2))
    assert MLPSpeculatorConfig(emb_dim=E, vocab_size=V).hidden_dim == E  # inner_dim 0 -> emb_dim


def test_step_matches_formula():
    m = _model(scale_input=True)
    h, tok = torch.randn(2, E), torch.tensor([3, 7])
    s0 = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2)
    x = m.proj[0].weight @ s0.T + (m.emb_weight / m.state_weight) * m.emb[0].weight[tok].T
    x = x.T
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * m.ln[0].weight + m.ln[0].bias
    s1 = torch.nn.functional.gelu(x)
    logits, state = m.step(0, m.prepare(h), tok)
    torch.testing.assert_close(state, s1)
    torch.testing.assert_close(logits, s1 @ m.head[0].weight.T)


def test_config_json_round_trip_every_key(tmp_path):
    cfg = _cfg(n_predict=4, n_candidates=7, tie_weights=True, scale_input=True,
               extra={"transformers_version": "4.40.0"})
    d = cfg.to_dict()
    assert d["model_type"] == "mlp_speculator"
    assert d["architectures"] == ["MLPSpeculatorPreTrainedModel"]
    assert {k: d[k] for k in ("emb_dim", "inner_dim", "n_predict", "n_candidates",
                              "top_k_tokens_per_head", "vocab_size", "tie_weights",
                              "scale_input")} == {
        "emb_dim": E, "inner_dim": D, "n_predict": 4, "n_candidates": 7,
        "top_k_tokens_per_head": [4, 3, 2, 2], "vocab_size": V, "tie_weights": True,
        "scale_input": True}
    assert MLPSpeculatorConfig.from_dict(json.loads(json.dumps(d))) == cfg
    m = _model(n_predict=4, n_candidates=7, tie_weights=True, scale_input=True)
    m.save_pretrained(tmp_path / "s")
    on_disk = json.loads((tmp_path / "s" / "config.json").read_text())
    assert on_disk["torch_dtype"] == "float32"
    assert {**MLPSpeculatorConfig.from_dict(on_disk).to_dict(), "torch_dtype": "float32"} == on_disk
    assert MLPSpeculatorConfig.from_dict(on_disk) == m.config


def test_from_dict_vllm_defaults():
    cfg = MLPSpeculatorConfig.from_dict({"model_type": "mlp_speculator", "emb_dim": E,
                                         "vocab_size": V})
    assert (cfg.n_predict, cfg.inner_dim, cfg.n_candidates) == (3, 0, 5)
    assert cfg.top_k_tokens_per_head == [5, 4, 3] and not cfg.tie_weights
    with pytest.raises(ValueError, match="model_type"):
        MLPSpeculatorConfig.from_dict({"model_type": "llama", "emb_dim": E, "vocab_size": V})


def test_top_k_tokens_per_head_length_error():
    with pytest.raises(ValueError, match="top_k_tokens_per_head"):
        MLPSpeculatorConfig(emb_dim=E, vocab_size=V, n_predict=4, top_k_tokens_per_head=[5, 4, 3])
    with pytest.raises(ValueError, match="top_k_tokens_per_head"):
        MLPSpeculatorConfig.from_dict({"model_type": "mlp_speculator", "emb_dim": E,
                                       "vocab_size": V, "n_predict": 2})
    with pytest.raises(ValueError, match="tie_weights"):
        _cfg(n_predict=1, tie_weights=True)


@pytest.mark.parametrize("tie", [False, True])
def test_tensor_names_exact(tmp_path, tie):
    m = _model(n_predict=3, tie_weights=tie)
    m.save_pretrained(tmp_path / "s")
    with safe_open(str(tmp_path / "s" / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    idx = [0] if tie else [0, 1, 2]
    expected = {}
    for i in idx:
        expected |= {f"emb.{i}.weight": (V, D), f"head.{i}.weight": (V, D),
                     f"ln.{i}.weight": (D,), f"ln.{i}.bias": (D,)}
    for i in ([0, 1] if tie else [0, 1, 2]):
        expected[f"proj.{i}.weight"] = (D, E) if i == 0 else (D, D)
    assert shapes == expected


def test_tie_weights_shares_parameters():
    m = _model(n_predict=4, tie_weights=True)
    for name in ("emb", "head", "ln"):
        mods = getattr(m, name)
        assert all(x is mods[0] for x in mods)
    assert m.proj[0] is not m.proj[1] and all(p is m.proj[1] for p in m.proj[1:])
    assert m.proj[0].weight.shape == (D, E) and m.proj[1].weight.shape == (D, D)
    n_params = sum(p.numel() for p in m.parameters())
    assert n_params == 2 * V * D + D * E + D * D + 2 * D
    untied = _model(n_predict=4)
    assert all(a is not b for a, b in zip(untied.emb, list(untied.emb)[1:]))


@pytest.mark.parametrize("tie,scale", [(False, False), (True, True)])
def test_save_load_identical_logits(tmp_path, tie, scale):
    m = _model(n_predict=3, tie_weights=tie, scale_input=scale)
    m.save_pretrained(tmp_path / "s")
    m2 = MLPSpeculator.from_pretrained(tmp_path / "s")
    assert not any(p.requires_grad for p in m2.parameters())
    if tie:
        assert m2.emb[2] is m2.emb[0] and m2.emb[2].weight is m2.emb[0].weight
        assert m2.proj[2].weight is m2.proj[1].weight
    h, toks = torch.randn(2, 5, E), torch.randint(0, V, (2, 5, 3))
    torch.testing.assert_close(m2.forward_train(h, toks), m.forward_train(h, toks),
                               rtol=0, atol=0)
    m.save_pretrained(tmp_path / "s")  # into an existing directory
    assert MLPSpeculator.from_pretrained(tmp_path / "s").config == m.config


def test_load_ignores_tied_copies_and_prefix(tmp_path):
    from infer.drafters.common import write_checkpoint
    m = _model(n_predict=3, tie_weights=True)
    state = {f"speculator.{k}": v for k, v in m.vllm_state_dict().items()}
    state["speculator.emb.2.weight"] = m.emb[0].weight.clone()
    state["speculator.proj.2.weight"] = m.proj[1].weight.clone()
    write_checkpoint(tmp_path / "s", m.config.to_dict(), state)
    m2 = MLPSpeculator.from_pretrained(tmp_path / "s")
    torch.testing.assert_close(m2.head[0].weight, m.head[0].weight)
    state["speculator.bogus"] = torch.zeros(1)
    write_checkpoint(tmp_path / "t", m.config.to_dict(), state)
    with pytest.raises(ValueError, match="bogus"):
        MLPSpeculator.from_pretrained(tmp_path / "t")


def test_forward_train_matches_draft_chain():
    m = _model(n_predict=3, scale_input=True)
    h = torch.randn(2, E)
    last = torch.tensor([1, 2])
    toks, logits = m.draft(h, last, 3)
    assert toks.shape == (2, 3) and logits.shape == (2, 3, V)
    teacher = torch.stack([last, toks[:, 0], toks[:, 1]], dim=-1)[:, None]  # [B, 1, 3]
    tf = m.forward_train(h[:, None], teacher)  # [3, B, 1, V]
    torch.testing.assert_close(tf[:, :, 0].transpose(0, 1), logits)
    with pytest.raises(ValueError, match="n_predict"):
        m.draft(h, last, 4)


def test_layer_norm_is_rms_without_mean():
    ln = MLPSpeculatorLayerNorm(4, affine=False)
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(ln(x), x)  # nn.LayerNorm would give zeros
