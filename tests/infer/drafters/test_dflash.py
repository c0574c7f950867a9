"""DFlash drafter: default aux ids (z-lab's formula + 1), the speculators config vLLM reads,
save -> load round trip with identical outputs, z-lab layout loading, KV injection by hand."""

import json

import pytest
import torch

from infer.drafters.dflash import ContextKV, DFlashConfig, DFlashDrafter, default_aux_layer_ids
from infer.kv_cache import KVCache
from infer.models.llama import inference_layout
from infer.models.loader import load_config, load_model
from infer.spec_config import SpeculativeConfig

from ..conftest import save_tiny_llama


@pytest.fixture(scope="module")
def target4(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("t4"), layers=4, seed=5)


def random_drafter(target_dir, seed=1, **kwargs) -> DFlashDrafter:
    cfg = DFlashConfig.for_target(load_config(target_dir), num_layers=2, mask_token_id=95,
                                  block_size=5, aux_layer_ids=[1, 3], **kwargs)
    drafter = DFlashDrafter(cfg, with_lm_head=cfg.draft_vocab_size != cfg.vocab_size)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 0.1)
    target = load_model(target_dir)
    drafter.share_target(target.embed_tokens, target.lm_head)
    return drafter


def test_default_aux_ids():
    assert default_aux_layer_ids(36, 5) == [2, 10, 18, 26, 34]  # z-lab [1, 9, 17, 25, 33] + 1
    assert default_aux_layer_ids(8, 2) == [2, 6]
    assert default_aux_layer_ids(8, 1) == [5]  # z-lab's single layer: the middle output
    assert default_aux_layer_ids(4, 3) == [2]  # tiny target: duplicates merged


def test_speculators_config_for_vllm(target4):
    d = random_drafter(target4).config.to_dict()
    assert d["speculators_model_type"] == "dflash" and d["architectures"] == ["DFlashDraftModel"]
    assert d["aux_hidden_state_layer_ids"] == [1, 3]  # vLLM: target_layer_ids = [0, 2]
    assert d["sliding_window_non_causal"] is True  # -> dflash_config.causal False in vLLM
    assert d["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert d["transformer_layer_config"]["model_type"] == "qwen3"
    assert "verifier" in d["speculators_config"] and d["mask_token_id"] == 95


def block(drafter, ctx_len=6, seed=0):
    """A block of 5 rows after ``ctx_len`` context positions: ``norm(h) [1, 5, H]``."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, ctx_len, drafter.fc.in_features, generator=g)
    kv = ContextKV(drafter.context_kv(drafter.context(aux), torch.arange(ctx_len)[None]))
    ids = torch.tensor([[7, 95, 95, 95, 95]])
    mask = torch.ones(1, 1, 5, ctx_len + 5, dtype=torch.bool)
    return drafter.block_forward(ids, torch.arange(ctx_len, ctx_len + 5)[None], mask, kv)


@pytest.mark.parametrize("vocab", [None, 48])
def test_save_load_identical(target4, tmp_path, vocab):
    drafter = random_drafter(target4, draft_vocab_size=vocab)
    if vocab:
        drafter.set_vocab(torch.arange(0, 96, 2))
    drafter.save_pretrained(tmp_path / "d")
    names = set(json.loads((tmp_path / "d" / "config.json").read_text()))
    assert "speculators_model_type" in names
    loaded = DFlashDrafter.from_pretrained(tmp_path / "d", dtype="float32")
    target = load_model(target4)
    loaded.share_target(target.embed_tokens, target.lm_head)
    state = loaded.state_dict()
    assert "embed_tokens.weight" not in state and ("d2t" in state) == bool(vocab)
    assert ("lm_head.weight" in state) == bool(vocab)  # full vocabulary: the target's head
    with torch.no_grad():
        want, got = block(drafter), block(loaded)
        torch.testing.assert_close(got, want)
        assert torch.equal(loaded.logits(got).argmax(-1), drafter.logits(want).argmax(-1))
    assert SpeculativeConfig.parse({"model": str(tmp_path / "d")}).method == "dflash"


def test_zlab_layout_loads(target4, tmp_path):
    drafter = random_drafter(target4)
    drafter.save_pretrained(tmp_path / "s")
    layer = drafter.config.transformer_layer_config
    zlab = {**layer, "architectures": ["DFlashDraftModel"], "block_size": 5,
            "dflash_config": {"mask_token_id": 95, "target_layer_ids": [0, 2]}}
    (tmp_path / "s" / "config.json").write_text(json.dumps(zlab))
    loaded = DFlashDrafter.from_pretrained(tmp_path / "s", dtype="float32")
    assert loaded.aux_layer_ids == (1, 3) and loaded.config.block_size == 5
    target = load_model(target4)
    loaded.share_target(target.embed_tokens, target.lm_head)
    with torch.no_grad():
        torch.testing.assert_close(block(loaded), block(drafter))


def test_context_keys_are_not_layernormed(target4):
    """KV injection: a context key is k_norm(k_proj(hidden_norm(fc(aux)))) roped, whatever
    input_layernorm holds (vLLM applies only hidden_norm to the context)."""
    drafter = random_drafter(target4)
    with torch.no_grad():
        before = block(drafter)
        drafter.layers[0].input_layernorm.weight.mul_(3.0)  # changes the block rows only
        ctx_only = drafter.context_kv(drafter.context(torch.ones(1, 2, drafter.fc.in_features)),
                                      torch.arange(2)[None])
        drafter.layers[0].input_layernorm.weight.div_(3.0)
        again = drafter.context_kv(drafter.context(torch.ones(1, 2, drafter.fc.in_features)),
                                   torch.arange(2)[None])
        torch.testing.assert_close(ctx_only[0][0], again[0][0])
        torch.testing.assert_close(block(drafter), before)


def test_mask_hidden_refused(target4, tmp_path):
    from safetensors.torch import load_file, save_file
    drafter = random_drafter(target4)
    drafter.save_pretrained(tmp_path / "m")
    state = load_file(tmp_path / "m" / "model.safetensors")
    state["mask_hidden"] = torch.zeros(1, 1, 64)
    save_file(state, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match="mask_hidden"):
        DFlashDrafter.from_pretrained(tmp_path / "m")


def test_a_cached_block_forward_runs_bundles_equal_to_the_modules(target4):
    """How the proposer runs a block in the draft cache: bundles with gradients off (built once),
    the modules with them on (nothing to record: the drafter is frozen); the same bits."""
    drafter = inference_layout(random_drafter(target4).requires_grad_(False))
    cache = KVCache.for_model(drafter.layer_config, 1, 16)
    cache.lens[0] = 3  # three context positions (their keys: zeros here)
    ids = torch.tensor([[7, 95, 95, 95, 95]])
    mask = torch.ones(1, 1, 5, 8, dtype=torch.bool)

    def block(grad: bool) -> torch.Tensor:
        step = cache.plan(1, 5)
        with torch.set_grad_enabled(grad):
            return drafter.block_forward(ids, step.positions, mask, step)

    want = block(True)
    assert "_weight_snapshot" not in drafter.__dict__
    got = block(False)
    assert "_weight_snapshot" in drafter.__dict__ and torch.equal(got, want)
