"""Tiny in-process targets and training data for the training tests (no network).

``train_target``: a 4-layer random Llama (GQA) with draftsmith's BPE tokenizer and chat template,
saved as a real Hugging Face directory. ``train_data``: chat examples through the real data
pipeline (chat template, assistant-only loss masks, packing) plus their draft vocabulary.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import datasets
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from train.config import TrainConfig
from train.data import prepare_dataset
from train.methods.base import METHODS
from train.tiny.corpus import train_tokenizer
from train.vocab import DraftVocab, build_draft_vocab

CODE = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n",
    "with open(path) as f:\n    data = f.read()\n",
    "if x > 0:\n    y = x\nelse:\n    y = -x\n",
]


def chat_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` user/assistant examples: the user quotes a code prefix, the assistant continues it."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text = rng.choice(CODE) + rng.choice(CODE)
        cut = rng.randint(5, len(text) // 2)
        rows.append({"messages": [{"role": "user", "content": text[:cut]},
                                  {"role": "assistant", "content": text[cut:]}]})
    return rows


def _foreign(name: str, **common):
    """A tiny random model of an architecture draftsmith's engine does not run (transformers'
    own classes; sliding windows and experts small enough to matter at these lengths)."""
    import transformers as tf

    layers = common["num_hidden_layers"]
    sliding = dict(sliding_window=8, layer_types=[
        "full_attention" if i == layers - 1 else "sliding_attention" for i in range(layers)])
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    experts = dict(num_experts_per_tok=2, head_dim=head_dim)
    kinds = {
        "gemma3": (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig, dict(head_dim=head_dim,
                                                                   **sliding)),
        "olmo2": (tf.Olmo2ForCausalLM, tf.Olmo2Config, {}),
        "stablelm": (tf.StableLmForCausalLM, tf.StableLmConfig, {}),  # LayerNorm, 1/4 rotary
        "gpt_oss": (tf.GptOssForCausalLM, tf.GptOssConfig,
                    dict(num_local_experts=4, **experts, **sliding,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    }
    model_cls, config_cls, extra = kinds[name]
    return model_cls(config_cls(**common, **extra))


FOREIGN = ("gemma3", "olmo2", "gpt_oss", "stablelm")


def save_train_target(path, *, layers: int = 4, hidden: int = 64, seed: int = 0,
                      arch: str = "llama") -> str:
    """A random target with the code tokenizer: Llama, or one of ``FOREIGN``."""
    tok = train_tokenizer(CODE * 4, vocab_size=400)
    torch.manual_seed(seed)
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=False,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  bos_token_id=None)
    model = LlamaForCausalLM(LlamaConfig(**common)) if arch == "llama" else _foreign(arch, **common)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@dataclass
class TrainData:
    target_dir: str
    dataset: datasets.Dataset  # packed rows (input_ids, loss_mask, position_ids, doc_ids)
    vocab: DraftVocab
    tokenizer: object


def thinking_target(train_target: str, out: Path) -> Path:
    """A copy of ``train_target`` whose chat template ends its generation prompt with
    ``# no thinking`` when rendered with ``enable_thinking=False``."""
    shutil.copytree(train_target, out)
    jinja = out / "chat_template.jinja"
    jinja.write_text(jinja.read_text() + "{% if add_generation_prompt and enable_thinking is "
                     "defined and not enable_thinking %}# no thinking\n{% endif %}")
    return out


@pytest.fixture(scope="session")
def train_target(tmp_path_factory) -> str:
    return save_train_target(tmp_path_factory.mktemp("train_target"))


@pytest.fixture(scope="session")
def train_data(train_target) -> TrainData:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(train_target)
    ds = prepare_dataset(datasets.Dataset.from_list(chat_rows(64)), tok, max_length=128,
                         verbose=False)
    vocab = build_draft_vocab(ds, len(tok), 128)
    return TrainData(train_target, ds, vocab, tok)


def feature_batches(train_data: TrainData, target, spec, *, rows: int, size: int) -> list[dict]:
    """The first ``rows`` packed rows in micro-batches of ``size``, with target features."""
    from train.data import collate, pad_token_id
    from train.features import capture

    pad = pad_token_id(train_data.tokenizer)
    data = [train_data.dataset[i] for i in range(min(rows, len(train_data.dataset)))]
    return [capture(target, collate(data[i:i + size], pad), spec)
            for i in range(0, len(data), size)]


def adam_steps(obj, batches: list[dict], steps: int = 30, lr: float = 3e-3):
    """A few plain Adam steps on an objective (the trainer is tested on its own); seeded."""
    torch.manual_seed(0)
    obj.train()
    opt = torch.optim.Adam([p for p in obj.parameters() if p.requires_grad], lr=lr)
    for i in range(steps):
        out = obj(batches[i % len(batches)])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return obj.eval()


def own_continuations(target_dir: str, batches: list[dict], tokenizer):
    """Stage-2-style data: 3 prompts, the target's greedy continuations (24 tokens) through the
    engine, and a collated batch whose loss covers exactly those continuations.
    Returns ``(prompts, params, continuations, batch)``."""
    from infer import LLM, SamplingParams
    from train.data import collate, pad_token_id

    ids = batches[0]["input_ids"]
    prompts = [ids[0, :12].tolist(), ids[1, 5:30].tolist(), [5, 6, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    base = [o.token_ids for o in LLM(target_dir, max_num_seqs=3).generate(prompts, params)]
    own = [{"input_ids": p + o, "loss_mask": [0] * len(p) + [1] * len(o)}
           for p, o in zip(prompts, base)]
    return prompts, params, base, collate(own, pad_token_id(tokenizer))


def method_cfg(method: str, **settings) -> TrainConfig:
    """A ``TrainConfig`` of ``method`` (its own drafter and objective settings classes, as
    ``drafter=METHOD`` composes), each ``KEY=value`` set on whichever section has ``KEY``."""
    drafter = METHODS.get(method)
    cfg = TrainConfig(drafter=drafter(), objective=drafter.objective_config())
    for key, value in settings.items():
        section = cfg.drafter if hasattr(cfg.drafter, key) else cfg.objective
        assert hasattr(section, key), f"{method} has no setting {key!r}"
        setattr(section, key, value)
    return cfg


# each method's recipe on the embedded tiny target (the default recipe, tiny_eagle3, sets
# EAGLE-3's keys, which another method's sections refuse)
TINY_RECIPES = {"dflash": "tiny_dflash", "dspark": "tiny_dspark", "eagle": "tiny_eagle",
                "eagle3": "tiny_eagle3",
                "mlp_speculator": "tiny_mlp", "mtp": "tiny_mtp", "pard": "tiny_pard",
                "peagle": "tiny_peagle"}
