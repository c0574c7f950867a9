"""Our EAGLE-3 drafter against a reference written from vLLM's semantics, not from our code.

The reference below reads a speculators checkpoint (``config.json`` + ``model.safetensors``) and
computes what vLLM 0.32's ``Eagle3LlamaForCausalLM`` computes with it, in plain torch:

- ``combine_hidden_states``: ``input_norm`` over the concatenated aux states when
  ``norm_before_fc``, then one ``fc_norm.i`` per aux chunk when ``fc_norm``, then ``fc``;
- decoder layer 0 (``LlamaDecoderLayer.forward``, ``layer_idx == 0``): ``embeds =
  input_layernorm(embed(ids))``; with ``norm_before_residual`` ``h = hidden_norm(g)`` is also the
  residual, else the residual is ``g`` itself; attention (Llama RoPE, neox halves, GQA, causal)
  over ``cat(embeds, h)``; then vLLM's fused add-and-norm: ``residual = attn + residual``,
  ``x = post_attention_layernorm(residual)``, ``out = mlp(x)``; the layer returns
  ``(out, residual)``;
- layers ``1 .. N - 1`` (``num_hidden_layers = N``; ``layer_idx > 0``, q/k/v over ``H``): the
  fused ``input_layernorm(out, residual)``: ``residual = out + residual``, ``x =
  input_layernorm(residual)``; attention over ``x`` (each layer its own KV), the same fused
  post-attention norm and MLP; ``hidden_norm`` is never used;
- the final fused ``norm(out, residual)`` (``LlamaModel.forward``): ``pre = out + residual``,
  ``hidden = norm(pre)``;
  logits ``lm_head(hidden)`` over the draft vocabulary, token ``i + d2t[i]``; the state fed to the
  next draft step is ``hidden`` when ``norm_output`` else ``pre``.

Every flag combination vLLM reads is compared, with one and with two decoder layers: the catch-up
pass over a prefix, then one chained draft step that feeds the fed-back state and the drafted
token at the next position.
"""

import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from infer.kv_cache import KVCache

from .test_eagle3 import inputs, make_drafter

FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def rms(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x, pos, theta):
    """Neox-style rotary embedding: ``x [T, heads, d]`` at positions ``pos [T]``."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None]  # [T, d/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class VllmEagle3:
    """vLLM's EAGLE-3 forward (module doc) over one sequence, keeping its own KV list."""

    def __init__(self, path):
        self.cfg = json.loads((path / "config.json").read_text())
        self.w = load_file(str(path / "model.safetensors"))
        layer = self.cfg["transformer_layer_config"]
        self.eps, self.theta = layer["rms_norm_eps"], layer.get("rope_theta", 10000.0)
        self.heads, self.kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
        self.head_dim = layer.get("head_dim") or layer["hidden_size"] // self.heads
        self.layers = layer.get("num_hidden_layers", 1)
        self.keys = {i: [] for i in range(self.layers)}  # layer -> [T, kv, d] per call
        self.values = {i: [] for i in range(self.layers)}

    def combine(self, aux):
        """``[T, n_aux * H_t]`` target aux states -> ``[T, H]``."""
        w, cfg = self.w, self.cfg
        if cfg.get("norm_before_fc", False):
            aux = rms(aux, w["input_norm.weight"], self.eps)
        if cfg.get("fc_norm", False):
            chunks = aux.chunk(len(cfg["eagle_aux_hidden_state_layer_ids"]), -1)
            aux = torch.cat([rms(c, w[f"fc_norm.{i}.weight"], self.eps)
                             for i, c in enumerate(chunks)], -1)
        return aux @ w["fc.weight"].T

    def attention(self, x, pos, layer):
        p = f"layers.{layer}.self_attn."
        t = x.shape[0]
        q = (x @ self.w[p + "q_proj.weight"].T).view(t, self.heads, self.head_dim)
        k = (x @ self.w[p + "k_proj.weight"].T).view(t, self.kv_heads, self.head_dim)
        v = (x @ self.w[p + "v_proj.weight"].T).view(t, self.kv_heads, self.head_dim)
        q, k = rope(q, pos, self.theta), rope(k, pos, self.theta)
        self.keys[layer].append(k)
        self.values[layer].append(v)
        keys, values = torch.cat(self.keys[layer]), torch.cat(self.values[layer])  # [S, kv, d]
        rep = self.heads // self.kv_heads
        keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        scores = torch.einsum("thd,shd->hts", q, keys) / math.sqrt(self.head_dim)
        s = keys.shape[0]
        causal = torch.ones(t, s, dtype=torch.bool).tril(s - t)  # new rows see all the past
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("hts,shd->thd", probs, values).reshape(t, -1)
        return out @ self.w[p + "o_proj.weight"].T

    def forward(self, ids, g, pos):
        """``ids [T]``, ``g [T, H]`` (combined or fed back), ``pos [T]`` -> (target token ids,
        draft logits, fed-back state)."""
        w, out, residual = self.w, g, None
        for i in range(self.layers):
            p = f"layers.{i}."
            if i == 0:
                embeds = rms(w["embed_tokens.weight"][ids], w[p + "input_layernorm.weight"],
                             self.eps)
                if self.cfg.get("norm_before_residual", False):
                    h = rms(out, w[p + "hidden_norm.weight"], self.eps)
                    residual = h
                else:
                    residual, h = out, rms(out, w[p + "hidden_norm.weight"], self.eps)
                x = torch.cat([embeds, h], -1)  # [T, 2H]
            else:  # the fused input_layernorm(hidden_states, residual)
                residual = out + residual
                x = rms(residual, w[p + "input_layernorm.weight"], self.eps)  # [T, H]
            residual = self.attention(x, pos, i) + residual
            x = rms(residual, w[p + "post_attention_layernorm.weight"], self.eps)
            out = (F.silu(x @ w[p + "mlp.gate_proj.weight"].T)
                   * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        pre = out + residual
        hidden = rms(pre, w["norm.weight"], self.eps)
        logits = hidden @ w["lm_head.weight"].T
        draft = logits.argmax(-1)
        return draft + w["d2t"][draft], logits, (hidden if self.cfg.get("norm_output") else pre)


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("values", list(itertools.product([False, True], repeat=len(FLAGS))))
def test_drafter_equals_vllm_semantics(tmp_path, values, num_layers):
    flags = dict(zip(FLAGS, values))
    d = make_drafter(seed=3, num_layers=num_layers, **flags)
    d.save_pretrained(tmp_path / "head")
    ref = VllmEagle3(tmp_path / "head")
    assert ref.layers == num_layers
    assert {k: ref.cfg.get(k, False) for k in FLAGS} == flags  # what vLLM reads, as trained
    ids, aux = inputs(b=1, t=6, seed=4)
    with torch.no_grad():
        want_tok, want_logits, want_state = ref.forward(ids[0], ref.combine(aux[0]),
                                                        torch.arange(6))
        cache = KVCache.for_model(d.layer_config, 1, 16)
        logits, state = d(ids, d.prepare(aux), cache, torch.tensor([0]))
        assert torch.allclose(logits[0], want_logits, atol=1e-4, rtol=1e-4)
        assert torch.allclose(state[0], want_state, atol=1e-4, rtol=1e-4)
        assert torch.equal(d.to_target_ids(logits[0].argmax(-1)), want_tok)
        # one chained draft step: the drafted token and the fed-back state, at position 6
        nxt = want_tok[-1:]
        step_tok, step_logits, _ = ref.forward(nxt, want_state[-1:], torch.tensor([6]))
        logits2, _ = d(nxt[None], state[:, -1:], cache, torch.tensor([0]))
    assert torch.allclose(logits2[0], step_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(d.to_target_ids(logits2[0].argmax(-1)), step_tok)
