"""Every recipe composes against the typed schema; bad keys and names fail at compose time."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from train.config import DEFAULT_RECIPE, TrainConfig, recipe_names, register_configs
from train.methods.base import METHODS

CONF = str(Path(__file__).resolve().parents[2] / "conf")
EXPECTED = {"tiny_eagle3", "tiny_eagle", "tiny_mlp", "tiny_pard", "tiny_peagle", "tiny_dflash",
            "tiny_dspark", "eagle3_llama8b", "eagle3_qwen3_8b", "eagle_llama8b", "mlp_llama8b",
            "pard_llama8b", "peagle_llama8b", "dflash_qwen3_8b", "dspark_qwen3_8b", "tiny_mtp",
            "mtp_mimo7b", "smollm2_eagle3", "smollm2_mtp", "smollm2_dflash", "smollm2_dspark",
            "smollm2_peagle", "smollm2_mlp", "smollm2_pard"}


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
    chosen = [d["override /drafter"] for d in OmegaConf.to_container(recipe.defaults)
              if isinstance(d, dict) and "override /drafter" in d]
    assert [cfg.drafter.method] == chosen  # the recipe's method was applied
    assert isinstance(cfg.drafter, METHODS.get(chosen[0]))
    assert isinstance(cfg.objective, METHODS.get(chosen[0]).objective_config)


def test_default_recipe_is_tiny_eagle3():
    cfg = OmegaConf.to_object(compose_train([]))
    assert cfg.name == DEFAULT_RECIPE == "tiny_eagle3" and cfg.drafter.method == "eagle3"


def test_llama8b_recipe_values():
    cfg = OmegaConf.to_object(compose_train(["recipe=eagle3_llama8b"]))
    assert cfg.target.path == "meta-llama/Llama-3.1-8B-Instruct"
    assert cfg.drafter.aux_layer_ids == [2, 16, 29] and cfg.drafter.draft_vocab_size == 32000
    assert cfg.objective.ttt_steps == 7 and cfg.trainer.lr == 1e-4
    assert cfg.trainer.mixed_precision == "bf16" and cfg.regenerate.enabled


@pytest.mark.parametrize("name", sorted(n for n in EXPECTED if n.startswith("smollm2_")))
def test_smollm2_recipes_train_on_the_offline_chat_set_and_evaluate_on_the_heldout_one(name):
    """Each includes recipes/shared/smollm2_chat.yaml and keeps its own method and name."""
    cfg = OmegaConf.to_object(compose_train([f"recipe={name}"]))
    assert cfg.target.path == "smollm2" and cfg.regenerate.enabled and cfg.name == name
    assert (cfg.data.source, cfg.eval.dataset) == ("draftsmith:chat-train",
                                                   "draftsmith:chat-heldout")
    assert [m["method"] for m in cfg.eval.methods] == ["ngram", "suffix"]
    cfg.validate()


def test_a_recipe_value_overrides_the_shared_part(tmp_path, monkeypatch):
    import train.config as config

    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "base.yaml").write_text("trainer:\n  lr: 0.5\n  max_steps: 7\n")
    (tmp_path / "child.yaml").write_text(
        "defaults:\n  - /recipe_shared/base\n  - _self_\ntrainer:\n  lr: 0.25\n")
    monkeypatch.setattr(config, "RECIPES_DIR", tmp_path)
    cfg = OmegaConf.to_object(compose_train(["recipe=child"]))
    assert (cfg.trainer.lr, cfg.trainer.max_steps, cfg.name) == (0.25, 7, "child")


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


# ---- every value is validated before any work starts ------------------------------------------

def composed(overrides) -> TrainConfig:
    return OmegaConf.to_object(compose_train(overrides))


@pytest.mark.parametrize("override, message", [
    # ints below their minimum, in every section
    ("data.num_examples=0", "'data.num_examples': 0; expected an integer >= 1"),
    ("data.max_length=1", "'data.max_length': 1; expected an integer >= 2"),
    ("features.rows_per_shard=0", "'features.rows_per_shard': 0; expected an integer >= 1"),
    ("drafter.num_layers=0", "'drafter.num_layers': 0; expected an integer >= 1"),
    ("objective.ttt_steps=0", "'objective.ttt_steps': 0; expected an integer >= 1"),
    ("trainer.micro_batch_size=0", "'trainer.micro_batch_size': 0; expected an integer >= 1"),
    ("regenerate.max_model_len=1", "'regenerate.max_model_len': 1; expected an integer >= 2"),
    ("eval.max_tokens=0", "'eval.max_tokens': 0; expected an integer >= 1"),
    ("eval.every_num_prompts=0", "'eval.every_num_prompts': 0; expected an integer >= 1"),
    # bounded ints (numpy's seed range)
    ("seed=-1", "'seed': -1; expected an integer in [0, 4294967295]"),
    ("data.seed=4294967296", "'data.seed': 4294967296; expected an integer in [0, 4294967295]"),
    # numbers out of range
    ("trainer.lr=0", "'trainer.lr': 0.0; expected a number in (0.0, inf]"),
    ("regenerate.temperature=-0.5", "'regenerate.temperature': -0.5; expected a number in [0.0"),
    ("regenerate.top_p=0", "'regenerate.top_p': 0.0; expected a number in (0.0, 1.0]"),
    ("objective.step_weight=-1", "'objective.step_weight': -1.0; expected a number in [0.0"),
    ("trainer.warmup_ratio=2", "'trainer.warmup_ratio': 2.0; expected a number in [0.0, 1.0]"),
    # lists: empty, or an item out of range (named by its index)
    ("eval.ks=[0]", "'eval.ks[0]': 0; expected an integer >= 1"),
    ("eval.ks=[]", "'eval.ks': []; expected a non-empty list"),
    ("eval.batch_sizes=[1,0]", "'eval.batch_sizes[1]': 0; expected an integer >= 1"),
    ("eval.temperatures=[-1]", "'eval.temperatures[0]': -1.0; expected a number in [0.0, inf]"),
    ("drafter.aux_layer_ids=[]", "'drafter.aux_layer_ids': []; expected a non-empty list"),
    ("trainer.betas=[0.9]", "'trainer.betas': [0.9]; expected two numbers in [0, 1)"),
    ("trainer.betas=[0.9,1.0]", "'trainer.betas': [0.9, 1.0]; expected two numbers in [0, 1)"),
    # strings that must name something
    ("logger.project=''", "'logger.project': ''; expected a non-empty string"),
    ("trainer.resume=''", "'trainer.resume': ''; expected a non-empty string"),
    ("data.split=''", "'data.split': ''; expected a non-empty string"),
    # the harness's methods: each a valid speculative_config without k
    ("eval.methods=[{method: ngram, prompt_lookup_max: 0}]",
     "eval.methods[0]: speculative_config: invalid value for 'prompt_lookup_max': 0"),
    ("eval.methods=[{method: ngram, num_speculative_tokens: 3}]",
     "'eval.methods[0].num_speculative_tokens': 3; expected no value: k comes from eval.ks"),
    ("eval.methods=[{method: nope}]", "eval.methods[0]: speculative_config: invalid value for "
                                      "'method': 'nope'"),
    ("eval.methods=[{method: ngram, ks: [3, 0]}]", "'eval.methods[0].ks[1]': 0; expected"),
    ("eval.methods=[{method: ngram, batch_sizes: [0]}]",
     "'eval.methods[0].batch_sizes[0]': 0; expected"),
])
def test_bad_values_are_refused_naming_key_value_and_allowed(override, message):
    from infer.foundation.errors import ConfigError

    cfg = composed([override])  # each passes Hydra's type check: only the value is wrong
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert message in str(err.value) and str(err.value).startswith("train config: ")


def test_values_built_in_python_are_type_checked_too():
    """Configs built in Python skip Hydra's type check; the rules catch the type as well."""
    from infer.foundation.errors import ConfigError

    for section, key, value, message in [
            ("data", "pack", 1, "'data.pack': 1; expected true or false"),
            ("features", "mode", "both", "'features.mode': 'both'; expected one of online | "
                                         "offline"),
            ("trainer", "device", "tpu", "'trainer.device': 'tpu'; expected one of auto | cpu"),
            ("logger", "mode", "loud", "'logger.mode': 'loud'; expected one of online | offline"
                                       " | disabled or None"),
            ("drafter", "num_layers", 2.5, "'drafter.num_layers': 2.5; expected an integer"),
            ("eval", "chat_template_kwargs", [1], "'eval.chat_template_kwargs': [1]; expected a "
                                                  "mapping")]:
        cfg = TrainConfig()
        setattr(getattr(cfg, section), key, value)
        with pytest.raises(ConfigError, match=message.replace("|", r"\|").replace("[", r"\[")):
            cfg.validate()


def test_every_field_has_a_rule_and_every_recipe_validates():
    """A field added without a rule would go unchecked: ``validate`` raises for it."""
    from infer.foundation.validation import check_fields

    for name in sorted(EXPECTED):
        composed([f"recipe={name}"]).validate()
    from dataclasses import dataclass, field

    @dataclass
    class Unruled:
        lr: float = field(default=1.0)  # a plain field, without setting(default, rule)

    with pytest.raises(RuntimeError, match=r"Unruled\.lr: no validation rule"):
        check_fields(Unruled(), "trainer", "train config")


def test_run_refuses_a_bad_value_before_any_work(tmp_path, monkeypatch):
    """``eval.ks=[0]`` used to fail after the whole training run; now nothing starts: no target
    is resolved or built, no output folder is created."""
    from infer.foundation.errors import ConfigError, MissingFileError
    import train.pipeline as pipeline

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the config was validated")

    monkeypatch.setattr(pipeline, "resolve_target", no_work)
    monkeypatch.setattr(pipeline, "prepare_data", no_work)
    out = tmp_path / "out"
    for override, error, message in [
            ("eval.ks=[0]", ConfigError, r"'eval\.ks\[0\]': 0"),
            ("data.num_examples=0", ConfigError, r"'data\.num_examples': 0"),
            (f"trainer.resume={tmp_path / 'nothing'}", MissingFileError,
             r"trainer\.resume=.*no checkpoint there"),
            ("+eval.chat_template_kwargs.enable_thinking=true", ConfigError,
             "contradicts data.enable_thinking=False")]:
        cfg = composed([f"output_dir={out}", "data.enable_thinking=false", override])
        with pytest.raises(error, match=message):
            pipeline.run(cfg)
    assert not out.exists()


def test_train_py_reports_a_bad_value_in_one_line_with_status_2(tmp_path):
    """The real entry point: no traceback, exit status 2, the key named, and no work done (no
    tiny target built into the empty cache, nothing but Hydra's log folder in the run dir)."""
    import os
    import subprocess
    import sys

    root = Path(CONF).parent
    env = {**os.environ, "DRAFTSMITH_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run([sys.executable, str(root / "train.py"), "eval.ks=[0]",
                           f"output_dir={tmp_path / 'out'}"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("train.py: error: train config: invalid value for "
                                   "'eval.ks[0]': 0; expected an integer >= 1")
    assert not (tmp_path / "cache").exists()
    assert [p.name for p in (tmp_path / "out" / "tiny_eagle3").iterdir()] in ([], ["hydra"])


def test_drafter_paths_checked_before_any_work(tmp_path):
    """drafter.init_from / drafter.model are read only after data preparation: a wrong path
    must fail at validation, naming the key."""
    import dataclasses

    from infer.foundation.errors import MissingFileError
    from train.config import TrainConfig
    from train.pipeline import validate

    from train.methods.pard import PardDrafterConfig, PardObjectiveConfig

    cfg = TrainConfig(drafter=PardDrafterConfig(), objective=PardObjectiveConfig())
    for key in ("init_from", "model"):
        bad = dataclasses.replace(cfg, drafter=dataclasses.replace(
            cfg.drafter, **{key: str(tmp_path / "nope")}), output_dir=str(tmp_path))
        with pytest.raises(MissingFileError, match=f"drafter.{key}="):
            validate(bad)
