"""Tiny random Llama checkpoints saved as real Hugging Face directories (no network)."""

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def save_tiny_llama(path, *, vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, seed=0,
                    eos=None, extra_config=None, std=0.5):
    """A random LlamaForCausalLM with GQA, saved with safetensors; returns the path as str.

    ``std``: weight-matrix init scale; 0.5 gives peaky, chaotic greedy outputs, ~0.1 gives
    outputs that fall into short loops (what n-gram / suffix drafting feeds on)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=256,
                      eos_token_id=eos, bos_token_id=None, pad_token_id=None,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # transformers 5 zero-inits some params; make every one random
        for p in model.parameters():
            p.normal_(0, std if p.ndim > 1 else 0.1)
            if p.ndim == 1:
                p.add_(1.0)
    if extra_config:
        for key, value in extra_config.items():
            setattr(model.config, key, value)
    model.save_pretrained(path)
    return str(path)


def copy_model(src, dst, **config_updates):
    """Copy a model directory, optionally overriding config.json keys; returns the path."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    if config_updates:
        cfg_path = Path(dst) / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update(config_updates)
        cfg_path.write_text(json.dumps(cfg, indent=2))
        gen_path = Path(dst) / "generation_config.json"  # keep EOS in one place
        if "eos_token_id" in config_updates and gen_path.exists():
            gen = json.loads(gen_path.read_text())
            gen["eos_token_id"] = config_updates["eos_token_id"]
            gen_path.write_text(json.dumps(gen, indent=2))
    return str(dst)


# prompts of different lengths, used by the engine tests (token ids < 96)
ENGINE_PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("target"), seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("draft"), hidden=16, layers=1, heads=2,
                           kv_heads=1, seed=1)


@pytest.fixture(scope="session")
def twin_draft(tiny_target, tmp_path_factory):
    """A draft identical to ``tiny_target`` (a copy of its directory): greedy drafts all pass."""
    return copy_model(tiny_target, tmp_path_factory.mktemp("twin"))


@pytest.fixture(scope="session")
def pard_draft(tiny_target, tmp_path_factory):
    """A PARD-style draft: the target's weights with ``pard_token`` in config.json, so draft 1
    (from the real context) is always right and the mask-token drafts usually are not."""
    vocab = json.loads((Path(tiny_target) / "config.json").read_text())["vocab_size"]
    return copy_model(tiny_target, tmp_path_factory.mktemp("pard"), pard_token=vocab - 1)


@pytest.fixture(scope="session")
def loopy_target(tmp_path_factory):
    """Small init scale: greedy outputs fall into short loops, so n-gram / suffix drafts hit."""
    return save_tiny_llama(tmp_path_factory.mktemp("loopy"), seed=1, std=0.1)


@pytest.fixture(scope="session")
def eos_target(tiny_target, tmp_path_factory):
    """``tiny_target`` whose EOS id is the token it emits most often under greedy decoding, so
    EOS lands early and (with ``twin_draft``) inside accepted prefixes. Returns (path, eos)."""
    model = LlamaForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    counts = Counter()
    with torch.no_grad():
        for prompt in ENGINE_PROMPTS:
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20,
                                 eos_token_id=None, pad_token_id=0)
            counts.update(out[0, len(prompt):].tolist())
    eos = counts.most_common(1)[0][0]
    return copy_model(tiny_target, tmp_path_factory.mktemp("eos"), eos_token_id=eos), eos


@pytest.fixture(scope="session")
def engine_prompts():
    """Token-id prompts of different lengths for the engine tests."""
    return [list(p) for p in ENGINE_PROMPTS]


@pytest.fixture(scope="session")
def make_tiny_llama(tmp_path_factory):
    """``make_tiny_llama(name, **save_tiny_llama_kwargs)`` -> path of a fresh tiny model."""

    def make(name, **kwargs):
        return save_tiny_llama(tmp_path_factory.mktemp(name), **kwargs)

    return make


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models run faster on one intra-op thread (no fork/join per op, no oversubscription
    on shared CI cores); restores the previous setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def save_tiny_mimo(path, *, vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, seed=0,
                   mtp_layers=1, std=0.5, eos=None):
    """A random MiMo checkpoint (``MiMoForCausalLM``: a Qwen2 body with q/k/v biases) with
    ``mtp_layers`` MTP layers under ``model.mtp_layers.{i}.*``, as Xiaomi ships it: written
    as a Qwen2 directory by transformers, then config.json retyped and the MTP tensors added
    (transformers has no native MiMo class). Returns the path as str."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=256,
                      eos_token_id=eos, bos_token_id=None, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std if p.ndim > 1 else 0.1)
            if p.ndim == 1 and p.shape[0] == hidden:
                p.add_(1.0)  # norms near 1
    model.save_pretrained(path)
    raw = json.loads((Path(path) / "config.json").read_text())
    raw.update(architectures=["MiMoForCausalLM"], model_type="mimo",
               num_nextn_predict_layers=mtp_layers)
    (Path(path) / "config.json").write_text(json.dumps(raw, indent=2))
    state = load_file(Path(path) / "model.safetensors")
    h, kv = hidden, kv_heads * (hidden // heads)
    shapes = {"token_layernorm.weight": (h,), "hidden_layernorm.weight": (h,),
              "input_proj.weight": (h, 2 * h), "input_layernorm.weight": (h,),
              "self_attn.q_proj.weight": (h, h), "self_attn.q_proj.bias": (h,),
              "self_attn.k_proj.weight": (kv, h), "self_attn.k_proj.bias": (kv,),
              "self_attn.v_proj.weight": (kv, h), "self_attn.v_proj.bias": (kv,),
              "self_attn.o_proj.weight": (h, h), "post_attention_layernorm.weight": (h,),
              "mlp.gate_proj.weight": (2 * h, h), "mlp.up_proj.weight": (2 * h, h),
              "mlp.down_proj.weight": (h, 2 * h), "final_layernorm.weight": (h,)}
    for i in range(mtp_layers):
        for name, shape in shapes.items():
            t = torch.randn(shape) * (std if len(shape) > 1 else 0.1)
            if name.endswith("layernorm.weight"):
                t += 1.0
            state[f"model.mtp_layers.{i}.{name}"] = t
    save_file(state, Path(path) / "model.safetensors", metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="session")
def mimo_target(tmp_path_factory):
    return save_tiny_mimo(tmp_path_factory.mktemp("mimo"), seed=2, std=0.3)


def price_verification(monkeypatch, costs: list[float] | None = None) -> None:
    """Adaptive verification priced by the test, not this machine: the verify forward at width
    ``w`` costs ``costs[w]`` (by default every width the same: every draft pays), and the
    engine's clock stands still (draft and verify seconds read 0, so a used width's cost only
    falls). A test's draft counts then do not depend on this machine's timings."""
    from types import SimpleNamespace

    import infer.engine
    from infer.runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "profile_verify",
                        lambda self, reqs, slots, w: (costs or [1.0] * w)[:w])
    monkeypatch.setattr(infer.engine, "time", SimpleNamespace(perf_counter=lambda: 0.0))
