"""Inference layouts (infer/models/layout.py): packed and fused linears compute what the plain
parameters do, and step aside whenever the parameters change or need gradients."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from infer.models.layout import (PACK_MIN_ELEMENTS, FusedLinear, PackedLinear, PackedWeight,
                                 pack_for_cpu_)
from infer.models.llama import Llama, ModelConfig

# the tests' weights are tiny: min_elements=0 packs them anyway (the default size rule has its
# own test below)
needs_packing = pytest.mark.skipif(PackedWeight.of(torch.zeros(2, 2)) is None,
                                   reason="this torch build cannot pack weights with oneDNN")


def tiny_llama(tied: bool = False, **overrides) -> Llama:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=48, tie_word_embeddings=tied, **overrides)
    return Llama(cfg).eval()


def uses_packed(linear: torch.nn.Linear) -> bool:
    return linear._packed is not None and linear._packed.describes(linear.weight)


@needs_packing
@pytest.mark.parametrize("tied", [False, True])
def test_packed_model_matches_plain_and_keeps_names(tied):
    model = tiny_llama(tied, qkv_bias=True)
    ids = torch.randint(0, 64, (3, 9))
    with torch.no_grad():
        ref = model.forward_train(ids).logits
        before = {k: v.clone() for k, v in model.state_dict().items()}
        pack_for_cpu_(model.fuse_projections(), min_elements=0)
        out = model.forward_train(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert isinstance(model.lm_head, PackedLinear) and isinstance(model.lm_head, torch.nn.Linear)
    assert model.layers[0].self_attn._qkv.packed is not None
    # fused parts run only when fusion cannot: they are left unpacked
    assert not isinstance(model.layers[0].self_attn.q_proj, PackedLinear)
    if tied:
        assert model.lm_head.weight is model.embed_tokens.weight


@needs_packing
def test_copies_and_pickles_drop_the_packing_and_still_compute():
    model = pack_for_cpu_(tiny_llama().fuse_projections(), min_elements=0)
    ids = torch.randint(0, 64, (2, 5))
    clones = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    with torch.no_grad():
        want = model.forward_train(ids).logits
        for clone in clones:
            assert clone.lm_head._packed is None
            torch.testing.assert_close(clone.forward_train(ids).logits, want)


@needs_packing
def test_a_shared_packed_linear_is_not_packed_again():
    target = pack_for_cpu_(tiny_llama(), min_elements=0)
    head = torch.nn.ModuleDict({"fc": torch.nn.Linear(8, 8), "lm_head": target.lm_head})
    packed = target.lm_head._packed
    pack_for_cpu_(head, min_elements=0)
    assert head["lm_head"]._packed is packed and isinstance(head["fc"], PackedLinear)


@needs_packing
def test_in_place_edits_and_replaced_data_fall_back_to_the_parameters():
    model = pack_for_cpu_(tiny_llama().fuse_projections(), min_elements=0)
    plain = tiny_llama()  # same seed: same weights, default layout
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        for m in (model, plain):  # an in-place edit (load_state_dict copies like this)
            m.lm_head.weight.mul_(2.0)
            m.layers[0].self_attn.k_proj.weight.add_(0.5)
            m.layers[1].mlp.up_proj.weight.sub_(0.25)
        assert not uses_packed(model.lm_head)
        torch.testing.assert_close(model.forward_train(ids).logits,
                                   plain.forward_train(ids).logits, rtol=1e-5, atol=1e-5)
        for m in (model, plain):  # .data replaced (as .to() / assign=True loading do)
            m.layers[1].mlp.down_proj.weight.data = m.layers[1].mlp.down_proj.weight.data * -1
            m.layers[0].self_attn.v_proj.weight.data = m.layers[0].self_attn.v_proj.weight * 3
        assert not model.layers[0].self_attn._qkv.active()
        torch.testing.assert_close(model.forward_train(ids).logits,
                                   plain.forward_train(ids).logits, rtol=1e-5, atol=1e-5)


@needs_packing
def test_gradients_flow_through_the_plain_parameters():
    model = pack_for_cpu_(tiny_llama().fuse_projections(), min_elements=0)
    plain = tiny_llama()
    ids = torch.randint(0, 64, (2, 6))
    grads = []
    for m in (model, plain):
        m.requires_grad_(True)
        m.forward_train(ids).logits.square().mean().backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, rtol=1e-5, atol=1e-6, msg=name)


@needs_packing
def test_a_weight_replaced_at_a_recycled_address_is_not_mistaken_for_the_packed_one():
    """The packing holds the packed weight's memory, so a replacement never reuses its address
    (and version 0 again); after a mismatch the packing is released, and repacking restores
    it. Writes through ``.data`` are invisible to the version counter: ``repack=True``."""
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    with torch.no_grad():
        for _ in range(20):  # several reloads between forwards: freed addresses get reused
            lin = torch.nn.Linear(64, 64, bias=False)
            lin.load_state_dict({"weight": torch.randn(64, 64)}, assign=True)
            pack_for_cpu_(lin, min_elements=0)
            for _ in range(4):
                lin.load_state_dict({"weight": torch.randn(64, 64)}, assign=True)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight))
        assert lin._packed.tensor is None  # the stale packing was dropped
        pack_for_cpu_(lin, min_elements=0)
        assert uses_packed(lin)
        lin.weight.data.copy_(torch.randn(64, 64))
        pack_for_cpu_(lin, repack=True, min_elements=0)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight))


def test_linears_with_mixed_biases_are_not_fused():
    lins = [torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 4)]
    assert not FusedLinear.can_fuse(lins)
    with pytest.raises(ValueError, match="biases"):
        FusedLinear(lins)


@pytest.mark.skipif(PackedWeight.of(torch.zeros(2, 2, dtype=torch.bfloat16)) is None,
                    reason="this CPU or build cannot run oneDNN's bf16 linear")
def test_bfloat16_packing_matches_plain_linear():
    weight, bias = torch.randn(24, 16).bfloat16(), torch.randn(24).bfloat16()
    lin = torch.nn.Linear(16, 24, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(weight)
        lin.bias.copy_(bias)
    pack_for_cpu_(lin, min_elements=0)
    x = torch.randn(3, 1, 16).bfloat16()
    with torch.no_grad():
        assert uses_packed(lin)
        torch.testing.assert_close(lin(x), F.linear(x, weight, bias), rtol=1e-2, atol=1e-2)


def test_fused_linear_concatenates_outputs_and_reports_replaced_parameters():
    lins = [torch.nn.Linear(8, n) for n in (4, 6)]
    x = torch.randn(5, 8)
    want = torch.cat([lin(x) for lin in lins], -1).detach()
    fused = FusedLinear(lins)
    with torch.no_grad():
        assert fused.active()
        torch.testing.assert_close(fused(x), want)
    assert not fused.active()  # gradients recorded for the parameters: run them separately
    lins[1].bias = torch.nn.Parameter(torch.zeros(6))
    with torch.no_grad():
        assert not fused.active()


def test_unpackable_weights_stay_plain(monkeypatch):
    """fp16, CUDA-less builds, CPUs oneDNN refuses: plain F.linear, no error."""
    lin = torch.nn.Linear(4, 4, dtype=torch.float16)
    pack_for_cpu_(lin, min_elements=0)
    assert type(lin) is torch.nn.Linear
    monkeypatch.setattr("infer.models.layout._packing_works", lambda dtype: False)
    model = pack_for_cpu_(tiny_llama().fuse_projections(), min_elements=0)
    assert type(model.lm_head) is torch.nn.Linear and model.layers[0].mlp._gate_up.packed is None
    with torch.no_grad():
        model.forward_train(torch.randint(0, 64, (1, 4)))


@needs_packing
def test_by_default_only_weights_big_enough_to_gain_are_packed():
    """oneDNN's fixed per-call cost exceeds a small projection's whole MKL time (module doc):
    by default a weight below PACK_MIN_ELEMENTS runs F.linear, one at or above it is packed."""
    small = torch.nn.Linear(128, 704, bias=False)  # the tiny target's gate/up: 90K elements
    big = torch.nn.Linear(128, PACK_MIN_ELEMENTS // 128, bias=False)
    model = torch.nn.ModuleDict({"small": small, "big": big})
    pack_for_cpu_(model)
    assert type(small) is torch.nn.Linear and isinstance(big, PackedLinear) and uses_packed(big)
    x = torch.randn(2, 128)
    with torch.no_grad():
        torch.testing.assert_close(big(x), F.linear(x, big.weight), rtol=1e-5, atol=1e-5)
