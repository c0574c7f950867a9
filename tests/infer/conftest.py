"""Tiny random Llama checkpoints saved as real Hugging Face directories (no network)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def save_tiny_llama(path, *, vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, seed=0,
                    eos=None, extra_config=None):
    """A random LlamaForCausalLM with GQA, saved with safetensors; returns the path as str."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=256,
                      eos_token_id=eos, bos_token_id=None, pad_token_id=None,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # transformers 5 zero-inits some params; make every one random
        for p in model.parameters():
            p.normal_(0, 0.5 if p.ndim > 1 else 0.1)
            if p.ndim == 1:
                p.add_(1.0)
    if extra_config:
        for key, value in extra_config.items():
            setattr(model.config, key, value)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("target"), seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("draft"), hidden=16, layers=1, heads=2,
                           kv_heads=1, seed=1)
