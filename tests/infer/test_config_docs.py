"""Every schema field is documented, ``--help`` shows it, and enum fields reject bad values at
compose time with the allowed ones listed."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from infer.config import EvalConfig, InferConfig
from infer.config_docs import field_docs, schema_help
from train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]


def sections(cls):
    """``cls`` and every dataclass nested in it."""
    found = [cls]
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            found += sections(type(default))
    return found


@pytest.mark.parametrize("schema", [TrainConfig, InferConfig])
def test_every_field_has_a_docstring(schema):
    missing = [f"{cls.__name__}.{f.name}" for cls in sections(schema)
               for f in dataclasses.fields(cls) if not field_docs(cls).get(f.name)]
    assert missing == []


def test_schema_help_lines():
    text = schema_help(TrainConfig)
    assert "trainer.schedule: 'cosine' (cosine | linear | constant) -- Decay after the" in text
    assert "data.format: None (openai | sharegpt | prompt_completion | text) --" in text
    assert "eval.ks: [3] --" in text  # train.py's own defaults
    assert "\nmethods: [{'method': 'ngram'}, {'method': 'suffix'}" in schema_help(EvalConfig)


@pytest.mark.parametrize("entry, line", [
    ("train.py", "features.mode: 'online' (online | offline) -- online: the frozen target"),
    ("infer.py", "mode: 'generate' (generate | eval | serve) -- generate: outputs"),
    ("infer.py", "serve.port: 8000 -- TCP port"),
    ("infer.py", "sampling.top_p: 1.0 -- Nucleus sampling"),  # SamplingParams' own docstrings
])
def test_help_prints_the_settings(entry, line):
    out = subprocess.run([sys.executable, entry, "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert line in out.stdout
    assert "recipe: " in out.stdout or entry == "infer.py"


@pytest.mark.parametrize("name, override, allowed", [
    ("train", "trainer.schedule=exp", "cosine, linear, constant"),
    ("train", "features.mode=both", "online, offline"),
    ("train", "logger.kind=tensorboard", "wandb, none"),
    ("infer", "mode=train", "generate, eval, serve"),
    ("infer", "serve.log_level=loud", "critical, error, warning, info, debug"),
])
def test_bad_enum_values_fail_at_compose_time(name, override, allowed):
    if name == "train":
        from train.config import register_configs
    else:
        from infer.config import register_configs
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        with pytest.raises(Exception) as err:
            compose(config_name=name, overrides=[override])
    chain = f"{err.value} {err.value.__cause__}"
    assert override.split("=")[1] in chain and f"expected one of [{allowed}]" in chain
