"""MiMo's MTP layers (``infer/drafters/mtp.py``) against a reference written from vLLM's
``mimo_mtp.py`` semantics, not from our code; the MiMo target body against transformers' Qwen2.

The reference reads the MiMo checkpoint (``config.json`` + ``model.safetensors``) and computes
what vLLM 0.32's ``MiMoMultiTokenPredictorLayer.forward`` computes, in plain torch, for one
sequence of pairs ``(h_t, x_{t+1})`` at positions ``t``:

- ``e = embed(x)`` zeroed where the position is 0, then ``token_layernorm``; ``hidden_layernorm(h)``;
- ``u = input_proj(cat(hidden, e))`` (hidden FIRST);
- the Qwen2 decoder layer (``mtp_block``; q/k/v with bias, o without; neox RoPE at the pair's
  position; GQA; causal attention), called with ``residual=None`` and then ``residual + out``:
  ``r = u + attn(input_layernorm(u))``, ``out = r + mlp(post_attention_layernorm(r))``;
- ``final_layernorm(out)``; logits ``lm_head(o)`` with the TARGET's head (``compute_logits``).
"""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from infer.drafters.mtp import PREFIX, MTPDrafter, num_mtp_layers
from infer.foundation.errors import FileFormatError
from infer.kv_cache import KVCache
from infer.models.loader import load_model

from ..conftest import copy_model, save_tiny_mimo
from .test_eagle3_vllm_reference import rms, rope

TOL = 1e-5


class VllmMiMoMTP:
    """vLLM's MiMo MTP layer ``layer`` (module doc) over one sequence, causal attention."""

    def __init__(self, path, layer=0):
        self.cfg = json.loads((Path(path) / "config.json").read_text())
        self.w = load_file(str(Path(path) / "model.safetensors"))
        self.p = f"model.mtp_layers.{layer}."
        cfg = self.cfg
        self.eps = cfg["rms_norm_eps"]
        self.theta = (cfg.get("rope_parameters") or {}).get("rope_theta",
                                                            cfg.get("rope_theta", 10000.0))
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.heads

    def lw(self, name):
        return self.w[self.p + name]

    def __call__(self, ids, hidden, pos):
        """``ids [T]``, ``hidden [T, H]``, ``pos [T]`` -> ``(logits [T, V], o [T, H])``."""
        lw, eps = self.lw, self.eps
        e = self.w["model.embed_tokens.weight"][ids]  # [T, H]
        e = torch.where(pos[:, None] == 0, torch.zeros_like(e), e)
        e = rms(e, lw("token_layernorm.weight"), eps)
        h = rms(hidden, lw("hidden_layernorm.weight"), eps)
        u = torch.cat([h, e], dim=-1) @ lw("input_proj.weight").T  # [T, H]
        x = rms(u, lw("input_layernorm.weight"), eps)
        t, d = x.shape[0], self.head_dim
        q = (x @ lw("self_attn.q_proj.weight").T + lw("self_attn.q_proj.bias")).view(t, -1, d)
        k = (x @ lw("self_attn.k_proj.weight").T + lw("self_attn.k_proj.bias")).view(t, -1, d)
        v = (x @ lw("self_attn.v_proj.weight").T + lw("self_attn.v_proj.bias")).view(t, -1, d)
        q, k = rope(q, pos, self.theta), rope(k, pos, self.theta)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)  # [heads, T, T]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        a = torch.einsum("hqk,khd->qhd", att, v).reshape(t, -1) @ lw("self_attn.o_proj.weight").T
        r = u + a
        y = rms(r, lw("post_attention_layernorm.weight"), eps)
        mlp = (F.silu(y @ lw("mlp.gate_proj.weight").T) * (y @ lw("mlp.up_proj.weight").T)) \
            @ lw("mlp.down_proj.weight").T
        o = rms(r + mlp, lw("final_layernorm.weight"), eps)
        return o @ self.w["lm_head.weight"].T, o


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    return save_tiny_mimo(tmp_path_factory.mktemp("mimo_d"), seed=7, std=0.3)


@pytest.fixture(scope="module")
def target(mimo):
    return load_model(mimo, dtype="float32")


@pytest.fixture(scope="module")
def drafter(mimo, target):
    d = MTPDrafter.from_target(mimo, dtype="float32")
    d.attach_target(target)
    return d


def _inputs(seed, b=2, t=7, h=32, vocab=96):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    hidden = torch.randn(b, t, h, generator=g) * 2.0
    return ids, hidden


def test_forward_train_matches_vllm_reference(mimo, drafter):
    ref = VllmMiMoMTP(mimo)
    ids, hidden = _inputs(0)
    # row 0 starts at position 0 (its embedding is zeroed there), row 1 at position 5
    pos = torch.stack([torch.arange(7), torch.arange(5, 12)])
    with torch.no_grad():
        logits, o = drafter.forward_train(ids, hidden, position_ids=pos)
    assert logits.shape == (2, 7, 96) and o.shape == (2, 7, 32)
    for b in range(2):
        want_logits, want_o = ref(ids[b], hidden[b], pos[b])
        torch.testing.assert_close(o[b], want_o, atol=TOL, rtol=TOL)
        torch.testing.assert_close(logits[b], want_logits, atol=TOL, rtol=TOL)


def test_position_zero_ignores_the_token(drafter):
    """vLLM masks the embedding at position 0: the first pair's token does not matter there,
    and does elsewhere."""
    ids, hidden = _inputs(1, b=1, t=3)
    other = ids.clone()
    other[0, 0] = (ids[0, 0] + 1) % 96
    with torch.no_grad():
        a, _ = drafter.forward_train(ids, hidden)
        b, _ = drafter.forward_train(other, hidden)
        c, _ = drafter.forward_train(ids, hidden, position_ids=torch.arange(1, 4)[None])
        d, _ = drafter.forward_train(other, hidden, position_ids=torch.arange(1, 4)[None])
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert (c[0, 0] - d[0, 0]).abs().max() > 1e-3


def test_cached_catch_up_and_chain_match_reference(mimo, drafter):
    """The engine's use: a ragged catch-up pass over two rows, then two chained one-pair steps
    that feed ``o`` back at the next position; each equals the reference over the whole
    sequence so far (the cache holds the earlier pairs' keys)."""
    ref = VllmMiMoMTP(mimo)
    ids, hidden = _inputs(2, t=5)
    n = torch.tensor([5, 3])
    cache = KVCache.for_model(drafter.layer_config, 2, 16)
    with torch.no_grad():
        logits, o = drafter(ids, hidden, cache, num_tokens=n, logits_at=(n - 1)[:, None])
        seqs = [(ids[b, : n[b]], hidden[b, : n[b]]) for b in range(2)]
        for step in range(3):
            for b in range(2):
                s_ids, s_hid = seqs[b]
                want_logits, want_o = ref(s_ids, s_hid, torch.arange(len(s_ids)))
                torch.testing.assert_close(o[b, 0], want_o[-1], atol=TOL, rtol=TOL)
                torch.testing.assert_close(logits[b, 0], want_logits[-1], atol=TOL, rtol=TOL)
            if step == 2:
                break
            tok = logits.argmax(-1)  # [2, 1]
            seqs = [(torch.cat([seqs[b][0], tok[b]]), torch.cat([seqs[b][1], o[b]]))
                    for b in range(2)]
            logits, o = drafter(tok, o, cache)
    assert cache.lens.tolist() == [7, 5]


def hf_qwen2(path):
    """transformers' Qwen2ForCausalLM (float32, eval) on a MiMo checkpoint's body weights: the
    config retyped to Qwen2, the MTP tensors left out (strict load: nothing else missing)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in ("num_nextn_predict_layers",
                                                     "architectures", "model_type")}
    hf = Qwen2ForCausalLM(Qwen2Config(**raw)).float().eval()
    state = {k: v for k, v in load_file(str(Path(path) / "model.safetensors")).items()
             if not k.startswith(PREFIX)}
    hf.load_state_dict(state, strict=True)
    return hf


def test_body_equals_transformers_qwen2(mimo, target):
    """The MiMo body is Qwen2: same logits as transformers' Qwen2ForCausalLM on the same
    weights (MTP tensors left out), and aux stream ``num_layers`` is the residual stream before
    the final norm (what vLLM's MiMoModel hands the MTP layer)."""
    hf = hf_qwen2(mimo)
    seen = {}
    hook = hf.model.norm.register_forward_hook(lambda m, args, out: seen.update(pre=args[0]))
    ids = torch.tensor([[3, 17, 42, 5, 88, 0, 61, 9], [1, 2, 3, 4, 5, 6, 7, 8]])
    try:
        with torch.no_grad():
            want = hf(ids).logits
            out = target.forward_train(ids, aux_layer_ids=(target.config.num_layers,))
    finally:
        hook.remove()
    torch.testing.assert_close(out.logits, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.aux[0], seen["pre"], atol=1e-5, rtol=1e-5)
    assert target.config.qkv_bias and not target.config.o_bias


def test_native_state_dict_round_trips(mimo, drafter):
    names = set(drafter.native_state_dict())
    on_disk = {k for k in load_file(str(Path(mimo) / "model.safetensors")) if k.startswith(PREFIX)}
    assert names == on_disk and all(n.startswith("model.mtp_layers.0.") for n in names)
    assert "model.mtp_layers.0.input_proj.weight" in names
    assert "model.mtp_layers.0.self_attn.q_proj.bias" in names
    w = load_file(str(Path(mimo) / "model.safetensors"))
    for k, v in drafter.native_state_dict().items():
        assert torch.equal(v, w[k]), k


def test_from_target_without_mtp_layers_is_refused(tiny_target):
    with pytest.raises(FileFormatError, match="num_nextn_predict_layers"):
        MTPDrafter.from_target(tiny_target)


def test_declared_layers_without_tensors_are_refused(mimo, tmp_path):
    path = copy_model(mimo, tmp_path / "no_mtp")
    w = load_file(str(Path(path) / "model.safetensors"))
    save_file({k: v for k, v in w.items() if not k.startswith(PREFIX)},
              str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(FileFormatError, match=r"missing weights.*mtp_layers\.0.*MTP layers"):
        MTPDrafter.from_target(path)
    # two declared, one shipped: layer 1's tensors are named
    two = copy_model(mimo, tmp_path / "two_declared", num_nextn_predict_layers=2)
    with pytest.raises(FileFormatError, match=r"model\.mtp_layers\.1\."):
        MTPDrafter.from_target(two)


def test_two_layers_load_and_layer_zero_drafts(tmp_path, drafter):
    path = save_tiny_mimo(tmp_path / "two", seed=3, mtp_layers=2)
    assert num_mtp_layers(json.loads((Path(path) / "config.json").read_text())) == 2
    d = MTPDrafter.from_target(path, dtype="float32")
    assert len(d.mtp_layers) == 2 and not any(p.requires_grad for p in d.parameters())
    assert {k.split(".")[2] for k in d.native_state_dict()} == {"0", "1"}
    d.attach_target(load_model(path, dtype="float32"))
    ref = VllmMiMoMTP(path, layer=0)
    ids, hidden = _inputs(4, b=1, t=4)
    with torch.no_grad():
        logits, _ = d.forward_train(ids, hidden)
    torch.testing.assert_close(logits[0], ref(ids[0], hidden[0], torch.arange(4))[0],
                               atol=TOL, rtol=TOL)


def test_attach_target_checks_shapes(mimo, tmp_path):
    d = MTPDrafter.from_target(mimo, dtype="float32")
    with pytest.raises(RuntimeError, match="attach_target"):
        d.forward_train(*_inputs(0, b=1, t=2))
    wrong = load_model(save_tiny_mimo(tmp_path / "h48", hidden=48, heads=4, seed=1))
    with pytest.raises(FileFormatError, match="hidden_size 32"):
        d.attach_target(wrong)


def test_cached_steps_run_bundles_equal_to_the_modules(mimo):
    """How the proposer runs the layer: with gradients off, bundles built once (the shared
    embedding and LM head watched too); with them on, the modules (nothing to record); the same
    bits, and a replaced LM head under the drafter is seen."""
    drafter = MTPDrafter.from_target(mimo, dtype="float32")
    drafter.attach_target(load_model(mimo, dtype="float32"))
    ids, hidden = _inputs(5, b=1, t=6)

    def steps(grad: bool):
        cache = KVCache.for_model(drafter.layer_config, 1, 16)
        with torch.set_grad_enabled(grad):
            out = [drafter(ids[:, t:t + 1], hidden[:, t:t + 1], cache) for t in range(6)]
        return torch.cat([o[0] for o in out], 1), torch.cat([o[1] for o in out], 1)

    want = steps(True)
    got = steps(False)
    assert "_weight_snapshot" in drafter.__dict__
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    drafter.lm_head.weight = torch.nn.Parameter(torch.randn_like(drafter.lm_head.weight),
                                                requires_grad=False)
    want = steps(True)
    assert not torch.equal(want[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(steps(False), want))
