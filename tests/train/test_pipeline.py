"""train.py's composition and data stage on a tiny in-process target and a local jsonl dataset."""

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from train.config import TrainConfig, register_configs
from train.pipeline import prepare_data
from train.tiny.corpus import train_tokenizer
from train.vocab import DraftVocab

CONF = str(Path(__file__).resolve().parents[2] / "conf")
TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
         "class Point:\n    def __init__(self, x):\n        self.x = x\n"] * 5


def compose_train(overrides):
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose(config_name="train", overrides=overrides)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tok = train_tokenizer(TEXTS, vocab_size=300)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32,
                                         intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_misspelt_key_fails_at_compose_time():
    with pytest.raises(Exception, match="nonexistent"):
        compose_train(["data.nonexistent=1"])


def test_data_stage_writes_dataset_and_vocab(tmp_path, target_dir):
    rows = [{"messages": [{"role": "user", "content": t[:12]},
                          {"role": "assistant", "content": t[12:]}]} for t in TEXTS]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    dcfg = compose_train([f"output_dir={tmp_path / 'out'}", f"target.path={target_dir}",
                          f"data.source={data}", "data.max_length=64", "drafter.draft_vocab_size=50"])
    cfg: TrainConfig = OmegaConf.to_object(dcfg)
    prepared = prepare_data(cfg)
    assert prepared.data_dir == tmp_path / "out" / "tiny_eagle3" / "data"
    assert (prepared.data_dir / "dataset").is_dir()
    vocab = DraftVocab.load(prepared.data_dir)
    assert len(vocab.d2t) == 50 and int(vocab.t2d.sum()) == 50
    # every loss-masked training token that made the draft vocabulary maps back exactly
    ids = torch.tensor(prepared.dataset["input_ids"]).flatten()
    mask = torch.tensor(prepared.dataset["loss_mask"]).flatten().bool()
    assert int(vocab.counts.sum()) == int(mask.sum())
    assert set(ids[mask].tolist()) >= set(vocab.target_ids()[vocab.counts[vocab.target_ids()] > 0]
                                          .tolist())


def test_missing_target_path_is_named(tmp_path):
    cfg: TrainConfig = OmegaConf.to_object(compose_train(["target.path=/no/such/dir"]))
    with pytest.raises(FileNotFoundError, match="target.path"):
        prepare_data(cfg)
