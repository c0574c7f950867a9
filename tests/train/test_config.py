"""Every recipe composes against the typed schema; bad keys and names fail at compose time."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from train.config import DEFAULT_RECIPE, TrainConfig, recipe_names, register_configs

CONF = str(Path(__file__).resolve().parents[2] / "conf")
EXPECTED = {"tiny_eagle3", "tiny_eagle", "tiny_mlp", "tiny_pard", "eagle3_llama8b",
            "eagle3_qwen3_8b", "eagle_llama8b", "mlp_llama8b", "pard_llama8b"}


def compose_train(overrides):
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose(config_name="train", overrides=overrides)


def test_every_named_recipe_exists():
    assert EXPECTED <= set(recipe_names())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_composes_to_typed_config(name):
    cfg = OmegaConf.to_object(compose_train([f"recipe={name}"]))
    assert isinstance(cfg, TrainConfig)
    assert cfg.name == name
    assert cfg.final_dir == Path("outputs") / name / "final"
    recipe = OmegaConf.load(Path(CONF).parent / "recipes" / f"{name}.yaml")
    assert cfg.drafter.method == recipe.drafter.method  # the recipe's delta was applied


def test_default_recipe_is_tiny_eagle3():
    cfg = OmegaConf.to_object(compose_train([]))
    assert cfg.name == DEFAULT_RECIPE == "tiny_eagle3" and cfg.drafter.method == "eagle3"


def test_llama8b_recipe_values():
    cfg = OmegaConf.to_object(compose_train(["recipe=eagle3_llama8b"]))
    assert cfg.target.path == "meta-llama/Llama-3.1-8B-Instruct"
    assert cfg.drafter.aux_layer_ids == [2, 16, 29] and cfg.drafter.draft_vocab_size == 32000
    assert cfg.objective.ttt_steps == 7 and cfg.trainer.lr == 1e-4
    assert cfg.trainer.mixed_precision == "bf16" and cfg.regenerate.enabled


def test_overrides_apply_on_top_of_the_recipe():
    cfg = OmegaConf.to_object(compose_train(["recipe=tiny_eagle", "trainer.lr=0.5"]))
    assert cfg.trainer.lr == 0.5 and cfg.drafter.method == "eagle"


def test_unknown_recipe_lists_the_available_ones():
    with pytest.raises(MissingConfigException) as err:
        compose_train(["recipe=no_such_recipe"])
    assert "no_such_recipe" in str(err.value) and "tiny_eagle3" in str(err.value)


def test_misspelt_key_is_named():
    with pytest.raises(ConfigCompositionException, match="lrr"):
        compose_train(["trainer.lrr=1"])


def test_misspelt_key_inside_a_recipe_is_named(tmp_path, monkeypatch):
    import train.config as config

    bad = tmp_path / "recipes"
    bad.mkdir()
    (bad / "broken.yaml").write_text("trainer:\n  learning_rate: 1.0\n")
    monkeypatch.setattr(config, "RECIPES_DIR", bad)
    with pytest.raises(Exception, match="learning_rate"):
        compose_train(["recipe=broken"])
