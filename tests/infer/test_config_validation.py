"""``python infer.py``'s values (InferConfig, and EvalConfig, which train.py uses too) are checked
before any model is built or loaded, each error naming the key, the value and what is allowed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from infer.config import EvalConfig, InferConfig, register_configs
from infer.foundation.errors import ConfigError, MissingFileError

ROOT = Path(__file__).resolve().parents[2]


def composed(overrides) -> InferConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return OmegaConf.to_object(compose(config_name="infer", overrides=overrides))


def test_defaults_validate():
    composed([]).validate()
    InferConfig().validate()


@pytest.mark.parametrize("override, message", [
    ("num_prompts=0", "'num_prompts': 0; expected an integer >= 1"),
    ("max_num_seqs=0", "'max_num_seqs': 0; expected an integer >= 1"),
    ("max_model_len=1", "'max_model_len': 1; expected an integer >= 2"),
    ("device=tpu", "'device': 'tpu'; expected 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ("eval.ks=[0]", "'eval.ks[0]': 0; expected an integer >= 1"),
    ("eval.batch_sizes=[0]", "'eval.batch_sizes[0]': 0; expected an integer >= 1"),
    ("eval.temperatures=[-1]", "'eval.temperatures[0]': -1.0; expected a number in [0.0, inf]"),
    ("eval.max_tokens=0", "'eval.max_tokens': 0; expected an integer >= 1"),
    ("eval.num_prompts=0", "'eval.num_prompts': 0; expected an integer >= 1"),
    ("eval.dataset_split=''", "'eval.dataset_split': ''; expected a non-empty string"),
    ("eval.methods=[{method: suffix, suffix_decoding_max_tree_depth: 0}]",
     "eval.methods[0]: speculative_config: invalid value for 'suffix_decoding_max_tree_depth'"),
    ("speculative_config={method: ngram}", "speculative_config: invalid value for "
                                           "'num_speculative_tokens': None"),
])
def test_bad_values_are_named(override, message):
    cfg = composed([override])
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert message in str(err.value)


def test_eval_config_names_its_section_and_lists():
    with pytest.raises(ConfigError, match=r"^harness check: invalid value for 'eval\.ks': \[\]; "
                                          r"expected a non-empty list$"):
        EvalConfig(ks=[]).validate("harness check")
    with pytest.raises(ConfigError, match=r"'eval\.methods\[1\]': 'ngram'; expected a "
                                          r"speculative_config mapping"):
        EvalConfig(methods=[{"method": "ngram"}, "ngram"]).validate("x")
    # draft_model without a model is completed by the entry point: only its shape is checked
    EvalConfig(methods=[{"method": "draft_model", "name": "tiny draft"}]).validate("x")


def test_infer_py_validates_before_building_anything(monkeypatch, tmp_path):
    """infer.py without model= builds the tiny target first (minutes on a first run): a bad
    value must stop it before that."""
    import train.tiny.build as build

    def no_work(**kwargs):
        raise AssertionError("the tiny target was built before the config was validated")

    monkeypatch.setattr(build, "ensure_tiny_target", no_work)
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("infer_entry", ROOT / "infer.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    for override in ("eval.ks=[0]", "max_num_seqs=0", "num_prompts=0"):
        with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
            entry.generate_or_eval(composed([override, "mode=eval"]))
    with pytest.raises(MissingFileError, match=r"prompts_file='nope\.jsonl': no such file"):
        entry.generate_or_eval(composed(["prompts_file=nope.jsonl"]))
