"""Weight snapshots (infer/models/snapshot.py): a cached forward runs bundles of the weights built
once, equal to the modules' forward bit for bit, and rebuilt whenever the weights change."""

import copy
import pickle

import pytest
import torch

from infer.kv_cache import KVCache
from infer.models.layout import PackedWeight, pack_for_cpu_
from infer.models.llama import Llama, ModelConfig
from infer.models.snapshot import WeightSnapshot

can_pack = PackedWeight.of(torch.zeros(2, 2)) is not None


def tiny_llama(seed: int = 0, **overrides) -> Llama:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=48, **overrides)
    return Llama(cfg).requires_grad_(False).eval()


def cached(model: Llama, ids: torch.Tensor, *, modules: bool = False) -> torch.Tensor:
    """Logits of a prefill then two one-token steps through a fresh cache: with gradients off
    (the snapshot's bundles), or on (``modules``: the modules' own forward, nothing to record)."""
    b, n = ids.shape
    cache = KVCache.for_model(model.config, b, 32)
    with torch.set_grad_enabled(modules):
        out = [model(ids[:, :n - 2], cache).logits]
        out += [model(ids[:, t:t + 1], cache).logits for t in (n - 2, n - 1)]
    return torch.cat(out, dim=1)  # [B, T, V]


def snapshot(model: Llama) -> WeightSnapshot | None:
    return model.__dict__.get("_weight_snapshot")


LAYOUTS = ["plain", "fused"] + (["packed"] if can_pack else [])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("flags", [{}, {"qkv_bias": True, "o_bias": True, "mlp_bias": True},
                                   {"qk_norm": True}, {"tie_word_embeddings": True}])
def test_bundles_compute_what_the_modules_do_bit_for_bit(layout, flags):
    model = tiny_llama(**flags)
    if layout != "plain":
        model.fuse_projections()
    if layout == "packed":
        pack_for_cpu_(model, min_elements=0)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    want = cached(model, ids, modules=True)
    assert snapshot(model) is None  # the modules' path builds no snapshot
    got = cached(model, ids)
    assert snapshot(model) is not None
    assert torch.equal(got, want)
    assert torch.equal(cached(model, ids), want)  # and again from the kept snapshot


def _edit_in_place(model, other):
    model.layers[0].mlp.down_proj.weight.mul_(-1.5)


def _assign_state(model, other):
    model.load_state_dict(other.state_dict(), assign=True)


def _replace_data(model, other):
    model.layers[1].self_attn.o_proj.weight.data = other.layers[1].self_attn.o_proj.weight.clone()


def _replace_layer(model, other):
    model.layers[1] = other.layers[1]


def _replace_norm_weight(model, other):
    weight = torch.rand(other.norm.weight.shape, generator=torch.Generator().manual_seed(5)) + 0.5
    model.norm.weight = torch.nn.Parameter(weight, requires_grad=False)


@pytest.mark.parametrize("edit", [_edit_in_place, _assign_state, _replace_data, _replace_layer,
                                  _replace_norm_weight])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_change_to_the_weights_is_never_missed(edit, layout):
    model, other = tiny_llama(0), tiny_llama(1)
    if layout != "plain":
        model.fuse_projections()
    if layout == "packed":
        pack_for_cpu_(model, min_elements=0)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(2))
    before = cached(model, ids)  # builds the snapshot
    edit(model, other)
    want = cached(model, ids, modules=True)
    assert not torch.equal(want, before)  # the edit matters
    assert torch.equal(cached(model, ids), want)


def test_a_new_layout_rebuilds_the_bundles():
    model = tiny_llama()
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(3))
    cached(model, ids)
    plain = snapshot(model).value
    model.fuse_projections()
    cached(model, ids)
    fused = snapshot(model).value
    assert plain.layers[0].self_attn.qkv is None and fused.layers[0].self_attn.qkv is not None
    torch.testing.assert_close(cached(model, ids), cached(model, ids, modules=True), rtol=0,
                               atol=0)


def test_copies_and_pickles_drop_the_snapshot():
    model = tiny_llama().fuse_projections()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(4))
    want = cached(model, ids)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert snapshot(clone) is None
        got = cached(clone, ids)  # a copy's fused blocks moved: it runs separate projections
        assert torch.equal(got, cached(clone, ids, modules=True))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert snapshot(clone).value.lm_head.weight is clone.lm_head.weight
