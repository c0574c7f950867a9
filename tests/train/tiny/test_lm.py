"""The tiny LMs' training loop (train/tiny/lm.py): bf16 autocast only where the CPU has it."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import train.tiny.lm as lm


def _native_bf16(monkeypatch, native: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)


SPEC = lm.TinyLMSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                     intermediate_size=64, steps=3, batch_size=2, warmup_steps=1)


@pytest.mark.parametrize("native", [True, False])
def test_autocast_is_bf16_only_when_asked_and_native(monkeypatch, native):
    _native_bf16(monkeypatch, native)
    assert lm.autocast_dtype(SPEC) == (torch.bfloat16 if native else None)
    fp32 = lm.TinyLMSpec(**{**SPEC.__dict__, "mixed_precision": "fp32"})
    assert lm.autocast_dtype(fp32) is None


def test_unknown_mixed_precision_is_refused_by_name():
    with pytest.raises(ValueError, match="mixed_precision.*'fp16'.*bf16, fp32"):
        lm.TinyLMSpec(**{**SPEC.__dict__, "mixed_precision": "fp16"})


@pytest.mark.parametrize("native", [True, False])
def test_train_lm_runs_forwards_under_autocast_and_keeps_fp32_weights(monkeypatch, native):
    _native_bf16(monkeypatch, native)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, max_position_embeddings=64))
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append(torch.is_autocast_enabled("cpu")))
    before = model.lm_head.weight.detach().clone()
    rows = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    stats = lm.train_lm(model, rows, SPEC, seed=0, progress=False)
    assert seen == [native] * 3
    assert stats["autocast"] == ("bfloat16" if native else None) and stats["steps"] == 3
    assert model.lm_head.weight.dtype == torch.float32
    assert not torch.equal(model.lm_head.weight, before)  # it trained
