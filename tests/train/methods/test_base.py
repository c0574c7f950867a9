"""Per-method settings (train/methods/): a method's drafter and objective sections hold only the
keys it reads, a foreign key fails at compose time naming the key and the method, and every
setting carries its rule and its resume sensitivity beside it."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from infer.foundation.errors import ConfigError
from train.config import explain_method_keys
from train.methods.base import METHODS, keys_of

from ..conftest import TINY_RECIPES
from ..test_config import CONF, compose_train

ALL = METHODS.names()


def _foreign(name: str, section: str) -> str | None:
    """A key some other method's ``section`` has and ``name``'s lacks."""
    own = set(keys_of(_section_cls(name, section)))
    for other in ALL:
        extra = sorted(set(keys_of(_section_cls(other, section))) - own)
        if extra:
            return extra[0]
    return None


def _section_cls(name: str, section: str) -> type:
    drafter = METHODS.get(name)
    return drafter if section == "drafter" else drafter.objective_config


def test_every_method_is_a_group_option_and_its_objective_follows():
    assert ALL == ["dflash", "dspark", "eagle", "eagle3", "mlp_speculator", "mtp", "pard",
                   "peagle"]
    for name in ALL:
        cfg = OmegaConf.to_object(compose_train([f"recipe={TINY_RECIPES[name]}",
                                                 f"drafter={name}"]))
        assert type(cfg.drafter) is METHODS.get(name) and cfg.drafter.method == name
        assert type(cfg.objective) is METHODS.get(name).objective_config


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("section", ["drafter", "objective"])
def test_a_key_the_method_lacks_fails_at_compose_time_naming_key_and_method(name, section):
    key = _foreign(name, section)
    if key is None:
        pytest.skip(f"every {section} key of another method is also {name}'s")
    with pytest.raises(ConfigCompositionException) as err:
        compose_train([f"recipe={TINY_RECIPES[name]}", f"{section}.{key}=1"])
    text = str(err.value) + str(err.value.__cause__)
    explained = explain_method_keys(text)
    assert f"{section}.{key}" in text
    assert f"the {name} method's {section} section has no such key" in explained
    for own in keys_of(_section_cls(name, section)):
        if own != "method":
            assert own in explained


def test_the_method_key_cannot_contradict_the_chosen_group():
    with pytest.raises(ConfigError, match=r"drafter\.method='mtp': the drafter chosen is "
                                          r"'eagle3'.*drafter=mtp"):
        OmegaConf.to_object(compose_train(["drafter.method=mtp"]))


@pytest.mark.parametrize("name", ALL)
def test_every_method_setting_has_a_rule_and_pins_a_resume(name):
    for cls in (METHODS.get(name), METHODS.get(name).objective_config):
        for f in dataclasses.fields(cls):
            assert callable(f.metadata.get("check")) and f.metadata.get("resume") is True, (
                cls.__name__, f.name)
        section = "drafter" if cls is METHODS.get(name) else "objective"
        from train.config import validate_section

        validate_section(section, cls())  # the defaults pass their own rules


def test_train_py_refuses_a_foreign_key_in_one_line_with_status_2(tmp_path):
    env = {**os.environ, "DRAFTSMITH_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run([sys.executable, str(Path(CONF).parent / "train.py"),
                           "drafter.n_predict=2", f"output_dir={tmp_path}"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("train.py: error: Could not override 'drafter.n_predict'")
    assert "the eagle3 method's drafter section has no such key" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "cache").exists()
