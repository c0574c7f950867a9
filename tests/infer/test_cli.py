"""``python infer.py``'s pieces: the prompts file, the mode check, the sampling keys of the
composed config, and a run whose batch holds refused prompts."""

import json
from dataclasses import fields
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from infer.cli import check_mode, read_prompts, run
from infer.config import InferConfig, Mode, register_configs
from infer.sampling import SamplingParams

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def test_prompts_file_formats(tmp_path):
    lines = tmp_path / "p.txt"
    lines.write_text("def f():\\n    return 1\n\n, second\n")
    assert read_prompts(str(lines)) == ["def f():\n    return 1", ", second"]
    csv = tmp_path / "p.csv"  # not a prompt set: text lines, as any other suffix
    csv.write_text("a,b\n")
    assert read_prompts(str(csv)) == ["a,b"]
    records = [{"prompt": "x", "question": "not this"}, {"prompt_token_ids": [3, 4]}]
    for name in ("p.jsonl", "p.json"):  # JSON Lines under a .json name too
        (tmp_path / name).write_text("\n".join(json.dumps(r) for r in records))
        assert read_prompts(str(tmp_path / name)) == ["x", [3, 4]]
    (tmp_path / "list.json").write_text(json.dumps(records))
    assert read_prompts(str(tmp_path / "list.json")) == ["x", [3, 4]]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "y"}))
    with pytest.raises(ValueError, match="record 1: expected 'prompt' or 'prompt_token_ids'"):
        read_prompts(str(tmp_path / "bad.jsonl"))
    with pytest.raises(FileNotFoundError, match="prompts_file="):
        read_prompts(str(tmp_path / "none.jsonl"))


def test_mode_check():
    assert check_mode(InferConfig(mode="eval")) is Mode.eval
    assert check_mode(InferConfig(mode="serve")) is Mode.serve
    with pytest.raises(ValueError, match=r"invalid value for 'mode': 'train'; expected one of "
                                         r"generate \| eval \| serve"):
        check_mode(InferConfig(mode="train"))


def compose_infer(overrides):
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose(config_name="infer", overrides=overrides)


def test_every_sampling_key_on_the_command_line():
    """Each SamplingParams field is a key of the typed config: sampling.KEY=VALUE, no "+"."""
    values = {"temperature": "0.7", "top_p": "0.9", "top_k": "5", "max_tokens": "32",
              "min_tokens": "2", "seed": "3", "stop_token_ids": "[1,2]", "ignore_eos": "true",
              "n": "1", "stop": "[return,'# end']"}
    assert set(values) == {f.name for f in fields(SamplingParams)}
    cfg = OmegaConf.to_object(compose_infer([f"sampling.{k}={v}" for k, v in values.items()]))
    assert SamplingParams.from_dict(cfg.sampling) == SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, max_tokens=32, min_tokens=2, seed=3,
        stop_token_ids=[1, 2], ignore_eos=True, stop=["return", "# end"])
    default = SamplingParams.from_dict(OmegaConf.to_object(compose_infer([])).sampling)
    assert default == SamplingParams(temperature=0.0, max_tokens=64)  # the rest: SamplingParams'


def test_bad_sampling_keys_and_values_are_named():
    with pytest.raises(ConfigCompositionException) as err:
        compose_infer(["sampling.topp=0.9"])
    assert "Key 'topp' not in 'SamplingParams'" in str(err.value.__cause__)
    with pytest.raises(ConfigCompositionException) as err:
        compose_infer(["sampling.top_k=many"])
    assert "'many'" in str(err.value.__cause__) and "sampling.top_k" in str(err.value.__cause__)
    with pytest.raises(ValueError, match=r"invalid value for 'top_p': 2.0; expected a number in "
                                         r"\(0.0, 1.0\]"):
        OmegaConf.to_object(compose_infer(["sampling.top_p=2"]))
    # Hydra lets "+" add a key to a typed node: the one validation path still refuses it
    cfg = OmegaConf.to_object(compose_infer(["+sampling.topp=0.9"]))
    with pytest.raises(ValueError, match=r"unknown key 'topp'; allowed keys: .*top_p"):
        SamplingParams.from_dict(cfg.sampling)


def test_run_reports_refused_prompts_per_request(tiny_target, tmp_path, capsys):
    """A batch with refused prompts: their rows carry the error, the others their tokens, and
    the printout (outputs, metrics table) and the results file come out whole."""
    out = tmp_path / "out.jsonl"
    cfg = InferConfig(sampling=SamplingParams(temperature=0.0, max_tokens=4), device="cpu",
                      output=str(out))
    rows = run(cfg, tiny_target, [[1, 2, 3], [], [1, 96]])
    printed = capsys.readouterr().out
    assert [len(r["token_ids"]) for r in rows] == [4, 0, 0]
    assert [r["finish_reason"] for r in rows] == ["length", "error", "error"]
    assert rows[0]["error"] is None
    assert rows[1]["error"] == "prompt 1: is empty; expected at least one token"
    assert rows[2]["error"].startswith("prompt 2: has token ids outside [0, 96): [96]")
    assert "=== prompt 1 (error) ===\n[] ||| refused: prompt 1: is empty" in printed
    assert f" ||| refused: {rows[2]['error']}" in printed
    assert "| mean acceptance length |" in printed
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
