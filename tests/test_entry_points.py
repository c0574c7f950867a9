"""The thin entry points: infer.py's embedded default picks up train.py's default output."""

import importlib.util
from pathlib import Path

import pytest

from infer.config import InferConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def infer_entry(monkeypatch, tmp_path):
    import train.tiny.corpus as tiny
    import train.tiny.build as build

    monkeypatch.setattr(build, "ensure_tiny_target", lambda **kw: "TARGET")
    monkeypatch.setattr(tiny, "default_draft_dir", lambda: "DRAFT")
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("infer_entry", ROOT / "infer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_uses_the_tiny_draft_until_train_py_made_a_head(infer_entry, tmp_path):
    cfg = InferConfig(num_prompts=1)
    target, prompts = infer_entry.default_model(cfg)
    assert target == "TARGET" and len(prompts) == 1
    assert cfg.speculative_config["method"] == "draft_model"
    assert cfg.speculative_config["model"] == "DRAFT"


def test_default_serves_the_default_recipes_final_head(infer_entry, tmp_path):
    head = tmp_path / "outputs" / "tiny_eagle3" / "final"
    head.mkdir(parents=True)
    (head / "config.json").write_text("{}")
    cfg = InferConfig(num_prompts=1)
    infer_entry.default_model(cfg)
    assert cfg.speculative_config == {"method": "eagle3", "model": str(infer_entry.DEFAULT_HEAD),
                                      "num_speculative_tokens": 3}
    assert {"method": "eagle3", "model": str(infer_entry.DEFAULT_HEAD),
            "name": "tiny_eagle3"} in cfg.eval.methods


def test_default_head_drafts_over_its_exported_token_map(infer_entry, tmp_path):
    """With the speculative_token_map.json that train.py exports (drafter.token_map_size), the
    default configuration and the evaluation's head row name it."""
    from infer.drafters.common import write_token_map

    head = tmp_path / "outputs" / "tiny_eagle3" / "final"
    head.mkdir(parents=True)
    (head / "config.json").write_text("{}")
    file = write_token_map(head, [1, 2, 3])
    cfg = InferConfig(num_prompts=1)
    infer_entry.default_model(cfg)
    assert cfg.speculative_config["speculative_token_map"] == str(infer_entry.DEFAULT_HEAD /
                                                                 file.name)
    row = next(m for m in cfg.eval.methods if m.get("name") == "tiny_eagle3")
    assert row["speculative_token_map"] == cfg.speculative_config["speculative_token_map"]


@pytest.fixture
def real_target(monkeypatch, tiny_gguf, tmp_path):
    """A converted real target: the converter is the real one, the GGUF the in-process one."""
    import train.real.targets as named

    monkeypatch.setattr(named, "locate_gguf", lambda target: (tiny_gguf[0], "0.0.9"))
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))


def test_named_target_generates_on_the_heldout_chat_questions(infer_entry, real_target):
    from infer.eval.chat_prompts import HELDOUT

    cfg = InferConfig(model="smollm2", num_prompts=2)
    target, prompts = infer_entry.named_model(cfg)
    assert target.endswith("smollm2-135m-instruct-0.0.9") and len(prompts) == 2
    assert all(q in p and p.endswith("<|im_start|>assistant\n") for q, p in zip(HELDOUT, prompts))
    assert cfg.speculative_config is None  # no head trained yet: plain decoding


def test_named_target_drafts_with_its_recipes_head_and_evaluates_on_chat(infer_entry,
                                                                        real_target, tmp_path):
    head = tmp_path / "outputs" / "smollm2_eagle3" / "final"
    head.mkdir(parents=True)
    (head / "config.json").write_text("{}")
    cfg = InferConfig(model="smollm2", mode="eval")
    target, prompts = infer_entry.named_model(cfg)
    assert prompts is None and cfg.eval.dataset == "draftsmith:chat-heldout"
    assert cfg.speculative_config == {"method": "eagle3", "num_speculative_tokens": 3,
                                      "model": str(Path("outputs/smollm2_eagle3/final"))}
    # the default draft_model row gets the draft derived from the target (train/real/draft.py);
    # the recipe's head joins
    assert [m["method"] for m in cfg.eval.methods] == ["ngram", "suffix", "draft_model", "eagle3"]
    assert cfg.eval.methods[2]["model"] == target + "-draft"
    assert cfg.eval.methods[-1]["name"] == "smollm2_eagle3"
