"""The entry points' contract: a user error is one line on stderr and exit status 2, a bug keeps
its traceback, HYDRA_FULL_ERROR=1 shows everything, and vLLM's JSON is accepted as pasted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infer.foundation.entry import hydra_value, json_override, user_errors
from infer.foundation.errors import ConfigError, Interrupted

ROOT = Path(__file__).resolve().parents[3]


def entry(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=300,
                          env={**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})})


def assert_user_error(run: subprocess.CompletedProcess, prog: str, *needles: str) -> None:
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]  # progress bars may precede
    assert lines[-1].startswith(f"{prog}: error: ") or lines[0].startswith(f"{prog}: error: "), \
        run.stderr
    for needle in needles:
        assert needle in run.stderr, run.stderr


# ---- in-process ------------------------------------------------------------------------------

def test_json_override_becomes_hydra_grammar():
    pasted = 'speculative_config={"method": "eagle3", "model": "/a b/it\'s", "k": [1, 2.5], ' \
             '"x": null, "on": true}'
    out = json_override(pasted)
    assert out == ("speculative_config={method: 'eagle3', model: '/a b/it\\'s', k: [1, 2.5], "
                   "x: null, on: true}")
    for plain in ("eval.ks=[1,3]", "speculative_config={method: ngram}", "seed=3", "name='a'",
                  'x={"not json', "--help"):
        assert json_override(plain) == plain
    assert hydra_value({"a": {"b": "c"}}) == "{a: {b: 'c'}}"


def test_hydra_value_round_trips_through_hydra():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    value = {"method": "ngram", "path": "C:\\x\\y'z\\'", "end": "a\\", "n": [1, {"m": None}],
             "f": 0.5}
    parsed = OverridesParser.create().parse_override(f"k={hydra_value(value)}")
    assert parsed.value() == value


def test_user_errors_exit_2_bugs_raise(capsys):
    with pytest.raises(SystemExit) as info, user_errors("prog"):
        raise ConfigError("invalid value for 'x'")
    assert info.value.code == 2
    assert capsys.readouterr().err == "prog: error: invalid value for 'x'\n"
    with pytest.raises(SystemExit) as info, user_errors("prog"):
        raise Interrupted("interrupted by SIGTERM at step 3; checkpoint saved to d", 15)
    assert info.value.code == 143 and "checkpoint saved to d" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info, user_errors("prog"):
        raise KeyboardInterrupt
    assert info.value.code == 130
    with pytest.raises(RuntimeError), user_errors("prog"):
        raise RuntimeError("a bug")


# ---- the real entry points, in subprocesses ------------------------------------------------

def test_bad_override_is_one_line_exit_2():
    assert_user_error(entry("infer.py", "sampling_typo.top_p=1"), "infer.py", "sampling_typo")
    assert_user_error(entry("train.py", "recipe=nope"), "train.py", "recipe/nope", "tiny_eagle3")
    full = entry("infer.py", "mode=nope", env={"HYDRA_FULL_ERROR": "1"})
    assert full.returncode == 1 and "Traceback" in full.stderr  # debugging keeps everything


def test_broken_model_file_is_one_line_exit_2(tiny_target, tmp_path):
    import shutil

    bad = tmp_path / "model"
    shutil.copytree(tiny_target, bad)
    (bad / "model.safetensors").write_bytes((bad / "model.safetensors").read_bytes()[:100])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n")
    run = entry("infer.py", f"model={bad}", f"prompts_file={prompts}", "device=cpu")
    assert_user_error(run, "infer.py", str(bad / "model.safetensors"), "truncated")


def test_pasted_vllm_json_runs(tiny_target, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n"
                               for p in ([1, 2, 3, 1, 2, 3], [4, 5])))
    out = tmp_path / "out.jsonl"
    run = entry("infer.py", f"model={tiny_target}", f"prompts_file={prompts}", f"output={out}",
                'speculative_config={"method": "ngram", "num_speculative_tokens": 2, '
                '"prompt_lookup_max": 3}', "sampling.max_tokens=5", "device=cpu")
    assert run.returncode == 0, run.stderr
    assert '"prompt_lookup_max": 3' in run.stdout  # the config the engine ran
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(r["token_ids"]) for r in rows] == [5, 5]


@pytest.mark.parametrize("config, override, needle", [
    ("train", "+trainer.lrr=1", "unknown key(s) trainer.lrr"),
    ("train", "trainer.lrr=1", "Key 'lrr' not in"),
    ("infer", "+sampling.topp=1", "unknown key(s) sampling.topp"),
    ("infer", "eval.ks=[one]", "eval.ks"),
])
def test_check_overrides_refuses_in_one_message(capsys, config, override, needle):
    from infer.config import register_configs as infer_configs
    from infer.foundation.entry import check_overrides
    from train.config import register_configs as train_configs

    infer_configs(), train_configs()
    with pytest.raises(SystemExit) as info:
        check_overrides(config, [override], "prog")
    err = capsys.readouterr().err
    assert info.value.code == 2 and needle in err and "+" + override not in err, err
    check_overrides(config, ["seed=3"], "prog")  # a good override passes silently
    assert capsys.readouterr().err == ""
