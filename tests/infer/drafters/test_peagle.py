"""P-EAGLE head: the speculators peagle config.json (keys vLLM 0.32 reads, its defaults), save ->
load identical, mask_hidden required, mask rows' features = prepare(mask_hidden), and the schema
infers eagle3 + parallel drafting from the checkpoint."""

import dataclasses
import json

import pytest
import torch

from infer.drafters.eagle3 import Eagle3Config
from infer.drafters.peagle import PEagleConfig, PEagleDrafter
from infer.foundation.errors import FileFormatError
from infer.models.loader import load_config
from infer.spec_config import SpeculativeConfig
from safetensors.torch import load_file, save_file

from ..conftest import save_tiny_llama


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("t4"), layers=4, seed=5)


def make_config(target, **flags) -> PEagleConfig:
    base = Eagle3Config.for_target(load_config(target), draft_vocab_size=48)
    values = {k: getattr(base, k) for k in base.__dataclass_fields__}
    values.update(speculative_tokens=5, norm_before_residual=False, embed_requires_grad=True)
    return PEagleConfig(**{**values, **flags}, mask_token_id=95)


def test_config_keys_vllm_reads(target):
    d = make_config(target).to_dict()
    assert d["speculators_model_type"] == "peagle" and d["architectures"] == ["PEagleSpeculator"]
    assert d["mask_token_id"] == 95 and d["transformer_layer_config"]["mask_token_id"] == 95
    spec = d["speculators_config"]
    assert spec["algorithm"] == "peagle"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert d["norm_before_residual"] is False and d["embed_requires_grad"] is True
    assert d["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert PEagleConfig.from_dict(d) == make_config(target)


def test_config_defaults_and_errors(target):
    d = make_config(target, norm_before_residual=True).to_dict()
    del d["norm_before_residual"]  # vLLM's update_peagle: absent -> False (eagle3: True)
    del d["mask_token_id"]  # still found inside transformer_layer_config
    cfg = PEagleConfig.from_dict(d)
    assert cfg.norm_before_residual is False and cfg.mask_token_id == 95
    del d["transformer_layer_config"]["mask_token_id"]
    with pytest.raises(ValueError, match="mask_token_id.*None"):
        PEagleConfig.from_dict(d)
    with pytest.raises(ValueError, match="speculators_model_type.*'peagle'"):
        PEagleConfig.from_dict({**make_config(target).to_dict(), "speculators_model_type": "eagle3"})
    with pytest.raises(ValueError, match="mask_token_id.*96"):
        make_config(target).__class__(**{**make_config(target).__dict__, "mask_token_id": 96})


def test_save_load_identical_and_mask_features(target, tmp_path):
    torch.manual_seed(0)
    head = PEagleDrafter(make_config(target, norm_before_fc=True), with_embedding=True)
    path = head.save_pretrained(tmp_path / "head")
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["mask_hidden"].shape == (1, 1, 3 * 32) and "embed_tokens.weight" in tensors
    loaded = PEagleDrafter.from_pretrained(path)
    assert dataclasses.replace(loaded.config, extra={}) == head.config  # + torch_dtype
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    with torch.no_grad():  # vLLM: combine_hidden_states(mask_hidden) = fc(input_norm(.))
        want = head.fc(head.input_norm(head.mask_hidden))
        torch.testing.assert_close(loaded.mask_features(), want)
    # a peagle checkpoint without mask_hidden names the file and the tensor
    del tensors["mask_hidden"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(FileFormatError, match=r"model\.safetensors.*'mask_hidden'"):
        PEagleDrafter.from_pretrained(path)


def test_schema_infers_eagle3_parallel(target, tmp_path):
    path = PEagleDrafter(make_config(target)).save_pretrained(tmp_path / "head")
    spec = SpeculativeConfig(model=str(path))
    assert spec.method == "eagle3" and spec.parallel_drafting is True
    assert spec.num_speculative_tokens == 5  # the depths trained
    raw = json.loads((path / "config.json").read_text())
    assert raw["speculators_model_type"] == "peagle"


def test_two_layer_head_save_load_identical(target, tmp_path):
    """speculators trains P-EAGLE with several layers: the config says num_hidden_layers, the
    weights carry layers.1.* (no hidden_norm), and the loaded head computes the same logits."""
    base = Eagle3Config.for_target(load_config(target), draft_vocab_size=48, num_layers=2)
    values = {k: getattr(base, k) for k in base.__dataclass_fields__}
    config = PEagleConfig(**{**values, "norm_before_residual": False}, mask_token_id=95)
    assert PEagleConfig.from_dict(config.to_dict()) == config
    torch.manual_seed(1)
    head = PEagleDrafter(config, with_embedding=True)
    path = head.save_pretrained(tmp_path / "head")
    names = set(load_file(str(path / "model.safetensors")))
    assert "layers.1.self_attn.q_proj.weight" in names
    assert "layers.1.hidden_norm.weight" not in names
    raw = json.loads((path / "config.json").read_text())
    assert raw["transformer_layer_config"]["num_hidden_layers"] == 2
    loaded = PEagleDrafter.from_pretrained(path)
    ids = torch.tensor([[3, 95, 95, 95]])
    with torch.no_grad():
        g = torch.cat([head.prepare(torch.randn(1, 1, 3 * 32)),
                       head.mask_features().expand(1, 3, -1)], 1)  # one pair + 3 mask rows
        want = head.forward_train(ids, g)
        got = loaded.forward_train(ids, g)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
