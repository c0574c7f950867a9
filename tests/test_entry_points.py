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
