"""The embedded default target builder, exercised on a generated corpus with tiny dimensions.

The full build (~6 min) is never run here: the same code path runs with a 20-file corpus, a
400-token vocabulary and 20 training steps, in seconds.
"""

import dataclasses
import json
import math
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

from train.tiny import build as tb
from train.tiny.unlikelihood import UnlikelihoodSpec
from train.tiny.corpus import (CHAT_TEMPLATE, DOC_TOKEN, EOS_TOKEN, default_cache_dir,
                               default_draft_dir, default_target_dir, pack_documents,
                               paired_draft_dir, stdlib_corpus, train_tokenizer,
                               training_documents)

TINY_LM = tb.TinyLMSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=128, steps=20, batch_size=8, lr=3e-3, warmup_steps=3,
                        unlikelihood=UnlikelihoodSpec(steps=2, prefix_tokens=8, new_tokens=8))
TINY_DRAFT = dataclasses.replace(TINY_LM, hidden_size=32, num_layers=1, num_heads=2,
                                 num_kv_heads=1, intermediate_size=64, steps=10,
                                 unlikelihood=UnlikelihoodSpec())


def _write_corpus(root):
    """20 small, varied Python modules (plus a skipped tests/ dir), like a miniature stdlib."""
    rng = random.Random(0)
    words = ["value", "scale", "name", "items", "count", "offset", "path", "data", "limit"]
    for i in range(20):
        lines = [f'"""Helpers for widget family {i}."""', "", "import os", "import sys", ""]
        for j in range(8):
            a, b = rng.sample(words, 2)
            lines += [f"def {a}_{b}_{i}_{j}({a}, {b}={j}):",
                      f'    """Return {a} combined with {b}."""',
                      f"    result = {a} * {b} + {rng.randint(0, 99)}",
                      f"    if result > {rng.randint(1, 50)}:",
                      "        return result - 1",
                      "    return result", ""]
        lines += [f"class Widget{i}:", '    """A widget."""', "",
                  "    def __init__(self, name):", "        self.name = name", ""]
        (root / f"mod_{i:02d}.py").write_text("\n".join(lines))
    (root / "tests").mkdir()
    (root / "tests" / "test_mod.py").write_text("def test_nothing():\n    pass\n")


@pytest.fixture(scope="module")
def tiny_cfg(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    _write_corpus(root)
    return tb.TinyBuildConfig(corpus_root=str(root), vocab_size=400, seq_len=64, eval_rows=8,
                              sample_tokens=8, target=TINY_LM, draft=TINY_DRAFT)


@pytest.fixture(scope="module")
def built(tiny_cfg, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache")
    target = tb.ensure_tiny_target(out / "tiny-target", with_draft=True,
                                   draft_dir=out / "tiny-draft", config=tiny_cfg, progress=False,
                                   num_threads=1)
    return target, out / "tiny-draft"


def test_build_loads_as_hugging_face_llama_with_gqa(built):
    target, draft = built
    model = AutoModelForCausalLM.from_pretrained(target)
    assert isinstance(model, LlamaForCausalLM)
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.num_key_value_heads < cfg.num_attention_heads
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.max_position_embeddings) == (64, 2, 2048)
    tok = AutoTokenizer.from_pretrained(target)
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == DOC_TOKEN
    assert cfg.vocab_size == len(tok) == 400
    gen = GenerationConfig.from_pretrained(target)
    assert set(gen.eos_token_id) == set(tok.convert_tokens_to_ids([EOS_TOKEN, DOC_TOKEN]))
    ids = tok("def f(x):\n", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(input_ids=ids).logits).all()

    draft_model = AutoModelForCausalLM.from_pretrained(draft)
    assert draft_model.config.hidden_size == 32 and draft_model.config.vocab_size == 400
    assert (draft / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()


def test_chat_template_and_eos(built):
    tok = AutoTokenizer.from_pretrained(built[0])
    assert json.loads((built[0] / "tokenizer_config.json").read_text())["chat_template"] \
        == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "def f(x):\n"},
                {"role": "assistant", "content": "    return x\n"}]
    assert tok.apply_chat_template(messages, tokenize=False) == \
        "<|user|>\ndef f(x):\n<|end|>\n<|assistant|>\n    return x\n<|end|>\n"
    assert tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) \
        .endswith("<|end|>\n<|assistant|>\n")
    for special in ("<|end|>", "<|user|>", "<|assistant|>", "<|endoftext|>"):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1
    assert tok.eos_token_id == tok.convert_tokens_to_ids(EOS_TOKEN)


def test_prompts_ending_at_a_line_end_tokenize_as_prefixes(built):
    """Newlines are never merged with the next line's indentation, so a prompt cut at a line end
    (or the template's generation prompt) is a token prefix of the full text."""
    tok = AutoTokenizer.from_pretrained(built[0])
    prompt, full = "class A:\n", "class A:\n    def f(self):\n        return 1\n\n\nx = A()\n"
    ids = tok(full)["input_ids"]
    assert ids[:len(tok(prompt)["input_ids"])] == tok(prompt)["input_ids"]
    assert tok.decode(ids) == full
    messages = [{"role": "user", "content": "class A:"},
                {"role": "assistant", "content": "    def f(self):\n        return 1"}]
    gen = tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    whole = tok(tok.apply_chat_template(messages, tokenize=False))["input_ids"]
    assert whole[:len(tok(gen)["input_ids"])] == tok(gen)["input_ids"]


def test_meta_records_split_loss_and_training(built, tiny_cfg):
    target, draft = built
    meta = tb.load_meta(target)
    assert meta["format_version"] == tb.FORMAT_VERSION and meta["kind"] == "target"
    train, held = meta["corpus"]["train_files"], meta["corpus"]["heldout_files"]
    assert train and held and not set(train) & set(held)
    assert sorted(train + held) == [f"mod_{i:02d}.py" for i in range(20)]  # tests/ skipped
    assert math.isfinite(meta["heldout_loss"]) and meta["heldout_loss"] > 0
    assert meta["heldout_loss_vs_unigram"] == pytest.approx(
        meta["heldout_loss"] / meta["heldout_unigram_loss"], abs=1e-3)
    assert 0.0 <= meta["greedy_repetition"] <= 1.0
    t = meta["training"]
    assert t["steps"] == 20 and not t["stopped_early"]
    assert meta["tokens_seen"] == 20 * 8 * 64
    assert t["unlikelihood"]["steps"] == 2 and meta["build_config"]["target"]["unlikelihood"][
        "steps"] == 2
    curve = [loss for _, loss in t["loss_curve"]]
    assert sum(curve[-5:]) / 5 < sum(curve[:5]) / 5 - 0.3  # the loss goes down
    assert meta["sample"]["prompt"].lstrip().startswith("def ")
    assert meta["model"]["num_key_value_heads"] < meta["model"]["num_attention_heads"]
    dmeta = tb.load_meta(draft)
    assert dmeta["kind"] == "draft" and dmeta["corpus"]["train_files"] == train
    assert dmeta["tokenizer"]["sha256"] == meta["tokenizer"]["sha256"]


def test_ensure_reuses_a_valid_cache(built, tiny_cfg, monkeypatch):
    target, draft = built
    stamps = {p: p.stat().st_mtime_ns for d in built for p in d.iterdir()}

    def no_build(*args, **kwargs):
        raise AssertionError("a valid cache was rebuilt")
    monkeypatch.setattr(tb, "build_tiny_target", no_build)
    monkeypatch.setattr(tb, "build_tiny_draft", no_build)
    assert tb.ensure_tiny_draft(draft, target_dir=target, config=tiny_cfg) == draft
    assert {p: p.stat().st_mtime_ns for d in built for p in d.iterdir()} == stamps
    # other settings are another build: the cached one is not silently used for them
    assert tb.check_tiny_build(target, "target", dataclasses.replace(tiny_cfg, seed=1)) \
        == "built with other settings"
    assert tb.check_tiny_build(target, "draft") is not None


@pytest.mark.parametrize("corruption", ["delete_weights", "garbage_weights", "old_version"])
def test_corrupt_cache_is_detected(built, tmp_path, corruption):
    copy = tmp_path / "tiny-target"
    shutil.copytree(built[0], copy)
    assert tb.check_tiny_build(copy, "target") is None
    if corruption == "delete_weights":
        (copy / "model.safetensors").unlink()
    elif corruption == "garbage_weights":
        (copy / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    else:
        meta = json.loads((copy / tb.META_FILE).read_text())
        meta["format_version"] = 0
        (copy / tb.META_FILE).write_text(json.dumps(meta))
    assert tb.check_tiny_build(copy, "target") is not None


def test_corrupt_cache_is_rebuilt(built, tiny_cfg, tmp_path):
    copy = tmp_path / "tiny-target"
    shutil.copytree(built[0], copy)
    (copy / "model.safetensors").write_bytes(b"not a safetensors file")
    assert tb.ensure_tiny_target(copy, with_draft=False, config=tiny_cfg, progress=False,
                                 num_threads=1) == copy
    assert tb.check_tiny_build(copy, "target", tiny_cfg) is None
    # fixed seeds and data order: the rebuild reproduces the original weights
    original = load_file(built[0] / "model.safetensors")
    rebuilt = load_file(copy / "model.safetensors")
    assert original.keys() == rebuilt.keys()
    assert all(torch.equal(original[k], rebuilt[k]) for k in original)


def test_interrupted_build_leaves_nothing_that_looks_complete(tiny_cfg, tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(tb, "train_lm", crash)
    with pytest.raises(KeyboardInterrupt):
        tb.build_tiny_target(tmp_path / "tiny-target", with_draft=False, config=tiny_cfg,
                             progress=False, num_threads=1)
    assert list(tmp_path.iterdir()) == []


def test_split_is_by_file_and_deterministic(tiny_cfg):
    a = stdlib_corpus(seed=0)
    assert a == stdlib_corpus(seed=0) and a != stdlib_corpus(seed=1)
    train, held = a
    assert not set(train) & set(held) and len(held) >= 1
    assert not any(part in ("test", "tests", "site-packages") for f in train + held
                   for part in f.split("/"))
    capped = tb.corpus_split(dataclasses.replace(tiny_cfg, corpus_root=None, max_files=10))
    assert capped == tb.corpus_split(dataclasses.replace(tiny_cfg, corpus_root=None, max_files=10))
    assert len(capped[1]) == 10 and set(capped[1]) <= set(train) and set(capped[2]) <= set(held)


def test_training_documents_mix_code_and_chat_examples():
    texts = ["\n".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(40))] * 3
    tok = train_tokenizer(texts, vocab_size=300)
    docs = training_documents(tok, texts, seed=0, chat_fraction=0.5)
    chats = [d for d in docs if d.startswith("<|user|>\n")]
    assert chats and len(docs) > len(chats)
    assert all(d.endswith("<|end|>\n") and "<|end|>\n<|assistant|>\n" in d for d in chats)
    assert docs == training_documents(tok, texts, seed=0, chat_fraction=0.5)
    rows = pack_documents(tok, docs, seq_len=32)  # [rows, 32]
    assert rows.shape[1] == 32 and (rows == tok.convert_tokens_to_ids(DOC_TOKEN)).any()


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "ds"))
    assert default_target_dir() == tmp_path / "ds" / "tiny-target"
    assert paired_draft_dir(default_target_dir()) == default_draft_dir() \
        == tmp_path / "ds" / "tiny-draft"
    assert paired_draft_dir(tmp_path / "mine") == tmp_path / "mine-draft"  # never the default
    monkeypatch.delenv("DRAFTSMITH_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "draftsmith"


def test_corpus_leaves_out_tables_and_tk(tmp_path):
    for rel in ("mod.py", "html/parser.py", "html/entities.py", "encodings/cp437.py",
                "tkinter/__init__.py", "pydoc_data/topics.py", "tests/test_mod.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    train, held = stdlib_corpus(seed=0, heldout_fraction=0.5, root=tmp_path)
    assert sorted(train + held) == ["html/parser.py", "mod.py"]
