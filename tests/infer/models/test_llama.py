"""The native Llama-family model against transformers, on tiny random checkpoints (fp32).

Each case is saved with ``save_pretrained`` and loaded back through ``infer.models.load_model``,
so the loader's name mapping and config parsing are exercised by every comparison.
"""

import json

import pytest
import torch
from transformers import (AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig,
                          Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

from infer.kv_cache import KVCache
from infer.models import (SUPPORTED_ARCHITECTURES, config_from_hf, load_model,
                          packed_causal_mask)
from infer.models.groups import ForwardGroup
from infer.models.loader import resolve_dtype

ATOL = 1e-4
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
CASES = {
    "llama_untied": lambda: LlamaConfig(**SMALL, tie_word_embeddings=False),
    "llama_tied": lambda: LlamaConfig(**SMALL, tie_word_embeddings=True),
    "llama3_rope": lambda: LlamaConfig(**SMALL, rope_theta=10000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16)),
    "mistral_window": lambda: MistralConfig(**SMALL, sliding_window=5),
    "qwen2_bias_yarn": lambda: Qwen2Config(**SMALL, rope_scaling=dict(
        rope_type="yarn", factor=8.0, original_max_position_embeddings=16)),
    # sliding window on layers >= max_window_layers only (per-layer masks)
    "qwen3_qknorm_window": lambda: Qwen3Config(**SMALL, head_dim=24, tie_word_embeddings=True,
                                               use_sliding_window=True, sliding_window=4,
                                               max_window_layers=1),
    # sparse experts (4, 2 per token, renormalised) on layers 1 and 2; layer 0 dense
    "qwen3_moe": lambda: Qwen3MoeConfig(**SMALL, head_dim=16, num_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=24,
                                        norm_topk_prob=True, mlp_only_layers=[0]),
    # q/k/v and gate/up fused in the checkpoint (split at load); a window on every layer
    "phi3_fused_window": lambda: Phi3Config(**SMALL, sliding_window=5, pad_token_id=0),
}


def randomize(model: torch.nn.Module) -> None:
    """Non-trivial values everywhere (HF zero-inits biases and one-inits norms)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.08)


def save_hf(hf_config, path, **save_kwargs):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config).float().eval()
    randomize(hf)
    hf.save_pretrained(path, **save_kwargs)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(transformers model, our loaded model) for one architecture case."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf(CASES[request.param](), path)
    return hf, load_model(path, dtype="float32")


def token_ids(batch, length, seed=1, vocab=SMALL["vocab_size"]):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_full_sequence_logits_and_hidden_states_match_transformers(pair):
    hf, model = pair
    ids = token_ids(2, 20)
    ref = hf(ids, output_hidden_states=True)
    n = model.config.num_layers
    out = model.forward_train(ids, aux_layer_ids=list(range(n + 1)))
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)
    # HF hidden_states[k] (k < N) = residual after k layers = our aux id k ...
    for k in range(n):
        torch.testing.assert_close(out.aux[k], ref.hidden_states[k], atol=ATOL, rtol=0)
    # ... but HF's last entry is after the final norm: our `hidden`; aux id N is before it.
    torch.testing.assert_close(out.hidden, ref.hidden_states[n], atol=ATOL, rtol=0)
    torch.testing.assert_close(model.norm(out.aux[n]), ref.hidden_states[n], atol=ATOL, rtol=0)


@torch.no_grad()
def test_cached_decoding_equals_full_sequence(pair):
    hf, model = pair
    ids = token_ids(2, 16, seed=2)
    full = model.forward_train(ids, aux_layer_ids=[1]).logits
    cache = KVCache.for_model(model.config, max_batch=2, max_len=32)
    pieces = [model(ids[:, :6], cache).logits]  # prefill
    for t in range(6, 16):
        pieces.append(model(ids[:, t:t + 1], cache).logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=ATOL, rtol=0)
    torch.testing.assert_close(full, hf(ids).logits, atol=ATOL, rtol=0)
    assert cache.lens.tolist() == [16, 16]


@torch.no_grad()
def test_one_row_decoding_equals_full_sequence(pair):
    """A one-row, one-token step attends its whole cache without a mask (sliding-window layers
    keep theirs: the sequence outgrows the windows)."""
    _, model = pair
    ids = token_ids(1, 14, seed=4)
    full = model.forward_train(ids).logits
    cache = KVCache.for_model(model.config, max_batch=3, max_len=32)
    slots = torch.tensor([1])
    pieces = [model(ids[:, :4], cache, slots).logits]
    pieces += [model(ids[:, t:t + 1], cache, slots).logits for t in range(4, 14)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=ATOL, rtol=0)


@torch.no_grad()
def test_sync_free_fixed_kv_len_matches(pair):
    _, model = pair
    ids = token_ids(2, 10, seed=3)
    full = model.forward_train(ids).logits
    cache = KVCache.for_model(model.config, max_batch=2, max_len=16)
    a = model(ids[:, :7], cache, kv_len=cache.capacity).logits
    b = model(ids[:, 7:], cache, kv_len=cache.capacity).logits
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=ATOL, rtol=0)


@torch.no_grad()
def test_ragged_batch_equals_rows_alone(pair):
    _, model = pair
    seqs = [token_ids(1, n, seed=10 + n)[0] for n in (9, 13, 11)]
    alone = [model.forward_train(s[None]).logits[0] for s in seqs]
    cache = KVCache.for_model(model.config, max_batch=4, max_len=14)
    slots = torch.tensor([2, 0, 3])
    # step 1: prompts of 3, 7, 5 tokens; step 2: 1, 3, 2 tokens; then row-wise remainders
    steps = [(3, 7, 5), (1, 3, 2), (5, 3, 4)]
    done = [0, 0, 0]
    for counts in steps:
        width = max(counts)
        batch = torch.zeros(3, width, dtype=torch.long)
        for r, c in enumerate(counts):
            batch[r, :c] = seqs[r][done[r]:done[r] + c]
        out = model(batch, cache, slots, num_tokens=torch.tensor(counts)).logits
        for r, c in enumerate(counts):
            want = alone[r][done[r]:done[r] + c]
            torch.testing.assert_close(out[r, :c], want, atol=ATOL, rtol=0)
            done[r] += c
    assert cache.lens[slots].tolist() == [9, 13, 11] and cache.lens[1].item() == 0


@torch.no_grad()
def test_grouped_forward_equals_its_groups_run_one_after_another(pair):
    """``forward_groups``: a ragged decode group in rows out of order, two unpadded prompts and
    a second group of one of the decode rows (planned after the first: it sees those keys) give
    each group what its own forward gives, and leave the same cache."""
    _, model = pair
    hist = token_ids(3, 10, seed=20)
    groups = [ForwardGroup(token_ids(3, 4, seed=21), torch.tensor([2, 0, 3]),
                           torch.tensor([4, 2, 3])),
              ForwardGroup(token_ids(1, 9, seed=22), torch.tensor([1]),
                           logits_at=torch.tensor([[8]])),
              ForwardGroup(token_ids(1, 5, seed=23), torch.tensor([4])),
              ForwardGroup(token_ids(1, 3, seed=24), torch.tensor([0]),
                           logits_at=torch.tensor([[0, 2]]))]
    caches = []
    for _ in range(2):
        cache = KVCache.for_model(model.config, max_batch=5, max_len=24)
        model(hist, cache, torch.tensor([2, 0, 3]), aux_layer_ids=[1])
        caches.append(cache)
    got = model.forward_groups(groups, caches[0], aux_layer_ids=[0, 2])
    for g, out in zip(groups, got):
        want = model(g.input_ids, caches[1], g.slots, num_tokens=g.num_tokens,
                     logits_at=g.logits_at, aux_layer_ids=[0, 2])
        real = (g.num_tokens if g.num_tokens is not None
                else torch.full((g.input_ids.shape[0],), g.input_ids.shape[1]))
        for row, n in enumerate(real.tolist()):  # padding's outputs are garbage
            pairs = [(out.hidden, want.hidden), *zip(out.aux, want.aux, strict=True)]
            if g.logits_at is None:
                pairs.append((out.logits, want.logits))
            for a, b in pairs:
                torch.testing.assert_close(a[row, :n], b[row, :n], atol=ATOL, rtol=0)
        if g.logits_at is not None:
            torch.testing.assert_close(out.logits, want.logits, atol=ATOL, rtol=0)
    assert caches[0].lens.tolist() == caches[1].lens.tolist() == [15, 9, 14, 13, 5]
    for row, n in enumerate(caches[0].lens.tolist()):
        torch.testing.assert_close(caches[0].k[:, row, :, :n], caches[1].k[:, row, :, :n],
                                   atol=ATOL, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("fixed_kv_len", [False, True])
def test_rollback_is_a_length_reset(pair, fixed_kv_len):
    _, model = pair
    prompt, drafts = token_ids(1, 6, seed=4), token_ids(1, 5, seed=5)
    fresh = token_ids(1, 2, seed=6)
    cache = KVCache.for_model(model.config, max_batch=3, max_len=16)
    slot = torch.tensor([1])
    model(prompt, cache, slot)
    model(drafts, cache, slot)  # verify 5 drafts; only the first is accepted
    before = cache.k.clone()
    cache.truncate(slot, 7)
    assert torch.equal(cache.k, before)  # rollback moves no data
    # stale draft keys at positions 9, 10 stay in the cache; a fixed kv_len still covers them
    kv_len = cache.capacity if fixed_kv_len else None
    got = model(fresh, cache, slot, kv_len=kv_len).logits
    seq = torch.cat([prompt, drafts[:, :1], fresh], 1)
    torch.testing.assert_close(got, model.forward_train(seq).logits[:, 7:], atol=ATOL, rtol=0)
    assert cache.lens.tolist() == [0, 9, 0]


@torch.no_grad()
def test_packed_documents_equal_separate_runs(pair):
    _, model = pair
    a, b = token_ids(1, 5, seed=7), token_ids(1, 9, seed=8)
    packed = torch.cat([a, b], 1)
    positions = torch.cat([torch.arange(5), torch.arange(9)])[None]
    docs = torch.tensor([[0] * 5 + [1] * 9])
    out = model.forward_train(packed, positions, packed_causal_mask(docs), aux_layer_ids=[2])
    for sl, doc in ((slice(0, 5), a), (slice(5, 14), b)):
        ref = model.forward_train(doc, aux_layer_ids=[2])
        torch.testing.assert_close(out.logits[:, sl], ref.logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.aux[0][:, sl], ref.aux[0], atol=ATOL, rtol=0)
    # the [B, T, T] form of the mask works the same
    out3 = model.forward_train(packed, positions, packed_causal_mask(docs)[:, 0])
    torch.testing.assert_close(out3.logits, out.logits)


@torch.no_grad()
def test_logits_at_selects_positions(pair):
    _, model = pair
    ids = token_ids(2, 8, seed=9)
    cache = KVCache.for_model(model.config, max_batch=2, max_len=8)
    at = torch.tensor([[7], [3]])
    out = model(ids, cache, logits_at=at, num_tokens=torch.tensor([8, 4]))
    full = model.forward_train(ids).logits
    torch.testing.assert_close(out.logits[:, 0], full[[0, 1], [7, 3]], atol=ATOL, rtol=0)


# ---- loader ------------------------------------------------------------------------------------

def test_sharded_checkpoint_loads(tmp_path):
    hf = save_hf(CASES["llama_untied"](), tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = load_model(tmp_path, dtype="float32")
    ids = token_ids(1, 7)
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(model.forward_train(ids).logits, want, atol=ATOL, rtol=0)


def test_bfloat16_load_and_config_fields(tmp_path):
    save_hf(CASES["llama_tied"](), tmp_path)
    model = load_model(tmp_path, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.embed_tokens.weight
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    cfg = model.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (3, 4, 2, 16)
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1 and cfg.model_type == "llama"
    cache = KVCache.for_model(cfg, 1, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        assert model(token_ids(1, 4), cache).logits.dtype == torch.bfloat16
    assert load_model(tmp_path).embed_tokens.weight.dtype == torch.float32  # auto = config dtype
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}) == torch.bfloat16  # 4.x key
    with pytest.raises(ValueError, match="'dtype'.*float16"):
        load_model(tmp_path, dtype="fp8")


def test_only_pickled_weights_is_refused(tmp_path):
    CASES["llama_untied"]().save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(FileNotFoundError, match="safetensors is required") as err:
        load_model(tmp_path)
    assert "pytorch_model.bin" in str(err.value) and str(tmp_path) in str(err.value)


def test_unsupported_architecture_lists_supported(tmp_path):
    GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        load_model(tmp_path)
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)


def test_moe_layers_follow_mlp_only_layers_and_sparse_step(tmp_path):
    from infer.models.llama import MLP, SparseMoE

    save_hf(CASES["qwen3_moe"](), tmp_path)
    model = load_model(tmp_path, dtype="float32")
    assert [type(layer.mlp) for layer in model.layers] == [MLP, SparseMoE, SparseMoE]
    assert model.layers[1].mlp.experts[3].gate_proj.weight.shape == (24, 64)
    hf = {**json.loads((tmp_path / "config.json").read_text()), "mlp_only_layers": [],
          "decoder_sparse_step": 2}
    assert config_from_hf(hf).moe_layers == (1,)  # every second layer


def test_partial_rotary_is_refused_by_name(tmp_path):
    Phi3Config(**SMALL, pad_token_id=0, partial_rotary_factor=0.75).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="partial_rotary_factor.*0.75"):
        load_model(tmp_path)


def test_missing_directory_and_config_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_transformers_4_and_5_rope_keys_agree():
    base = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=10,
                hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=64, eos_token_id=[3, 4])
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
    v4 = config_from_hf({**base, "rope_theta": 5e5,
                         "rope_scaling": {"rope_type": "llama3", **scaling}},
                        generation={"eos_token_id": 5})
    v5 = config_from_hf({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5,
                                                     **scaling}})
    assert v4.rope == v5.rope and v4.rope.type == "llama3" and v4.rope.theta == 5e5
    assert v4.eos_token_ids == (5, 3, 4) and v4.num_kv_heads == 2
    old_style = config_from_hf({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old_style.rope.type == "linear" and old_style.rope.theta == 10000.0
    with pytest.raises(ValueError, match="rope_type"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "longrope"}})
    # a 4.x Qwen2.5 config: a window is stored but switched off
    qwen = config_from_hf({**base, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                           "use_sliding_window": False, "sliding_window": 32768,
                           "max_window_layers": 0})
    assert qwen.sliding_window is None and qwen.qkv_bias and not qwen.o_bias


def test_grouped_attention_equals_repeated_keys():
    """The CUDA path for masked GQA (query heads folded into rows per kv head) is the same math
    as repeating every kv head for its query heads."""
    import torch.nn.functional as F

    from infer.models.attention import group_mask, grouped_attention, position_mask

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 4, 16, generator=gen)  # [B, heads, T, hd]
    k, v = torch.randn(2, 3, 2, 11, 16, generator=gen)  # [B, kv_heads, S, hd]
    mask = position_mask(torch.tensor([[2, 3, 4, 5], [7, 8, 9, 10], [0, 1, 2, 3]]),
                         torch.arange(11))  # [B, 1, T, S], ragged causal
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(4, dim=1),
                                          v.repeat_interleave(4, dim=1), attn_mask=mask)
    torch.testing.assert_close(grouped_attention(q, k, v, group_mask(mask, 4)), want)
