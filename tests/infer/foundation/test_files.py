"""Fault injection on the files a user points the engine at: the target, every drafter format
and the tokenizer. Each broken or mismatched file is one ``UserError`` naming the file (or the
key) and what is wrong, raised through the same ``LLM(...)`` call a user makes; never a raw
SafetensorError, JSONDecodeError or torch size-mismatch."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from infer.drafters.eagle import EagleConfig, EagleDrafter
from infer.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from infer.drafters.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig
from infer.engine import LLM
from infer.foundation.errors import FileFormatError, MissingFileError, UserError
from infer.foundation.files import load_tokenizer, read_json, read_safetensors
from infer.models.loader import load_config

pytestmark = pytest.mark.usefixtures("single_thread")


def heads_for(target: str, root: Path) -> dict[str, str]:
    """One checkpoint of each learned drafter format, shaped for ``target``."""
    cfg = load_config(target)
    torch.manual_seed(0)
    e3 = Eagle3Drafter(Eagle3Config.for_target(cfg, draft_vocab_size=cfg.vocab_size,
                                               aux_layer_ids=[0, 1, 2], speculative_tokens=3))
    e1 = EagleDrafter(EagleConfig.for_target(cfg))
    mlp = MLPSpeculator(MLPSpeculatorConfig.for_target(cfg, n_predict=3, inner_dim=16))
    for m in (e3, e1, mlp):
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.1)
    return {"eagle3": str(e3.save_pretrained(root / "eagle3")),
            "eagle": str(e1.save_pretrained(root / "eagle")),
            "mlp_speculator": str(mlp.save_pretrained(root / "mlp_speculator"))}


@pytest.fixture(scope="module")
def heads(tiny_target, tmp_path_factory):
    return heads_for(tiny_target, tmp_path_factory.mktemp("heads"))


@pytest.fixture(scope="module")
def foreign_heads(make_tiny_llama, tmp_path_factory):
    """Heads trained for another target (vocabulary 64, hidden 48, not the fixture's 96 / 32)."""
    other = make_tiny_llama("other", vocab=64, hidden=48, heads=4, kv_heads=2)
    return heads_for(other, tmp_path_factory.mktemp("foreign"))


def broken_copy(src: str, dst: Path, *, truncate: int | None = None, config: str | None = None,
                weights: str = "model.safetensors") -> str:
    shutil.copytree(src, dst)
    if truncate is not None:
        data = (dst / weights).read_bytes()
        (dst / weights).write_bytes(data[:truncate if truncate >= 0 else len(data) + truncate])
    if config is not None:
        (dst / "config.json").write_text(config)
    return str(dst)


def spec(method, model, k=3):
    return {"method": method, "model": model, "num_speculative_tokens": k}


def user_error(fn, *needles, kind=UserError) -> str:
    with pytest.raises(kind) as info:
        fn()
    message = str(info.value)
    for needle in needles:
        assert str(needle) in message, message
    return message


# ---- the target -----------------------------------------------------------------------------

@pytest.mark.parametrize("cut", [0, 6, 60, -1, -500])
def test_truncated_target_weights_name_the_file(tiny_target, tmp_path, cut):
    bad = broken_copy(tiny_target, tmp_path / "t", truncate=cut)
    user_error(lambda: LLM(bad), Path(bad) / "model.safetensors", "truncated or corrupt",
               kind=FileFormatError)


@pytest.mark.parametrize("text, needle", [("{not json", "is not valid JSON (line 1"),
                                          ("[1, 2]", "holds a JSON list"),
                                          ('{"architectures": ["LlamaForCausalLM"]}',
                                           "lacks required key(s) vocab_size")])
def test_broken_target_config_names_the_file(tiny_target, tmp_path, text, needle):
    bad = broken_copy(tiny_target, tmp_path / "t", config=text)
    msg = user_error(lambda: LLM(bad), Path(bad) / "config.json", kind=FileFormatError)
    assert needle.replace(" (line 1", "") in msg


def test_target_config_that_disagrees_with_its_weights(tiny_target, tmp_path):
    bad = broken_copy(tiny_target, tmp_path / "t")
    cfg = read_json(Path(bad) / "config.json")
    (Path(bad) / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 100}))
    user_error(lambda: LLM(bad), bad, "do not match its config.json", "mlp.gate_proj.weight",
               kind=FileFormatError)


def test_missing_target_paths(tiny_target, tmp_path):
    user_error(lambda: LLM(str(tmp_path / "nope")), "model directory not found",
               tmp_path / "nope", kind=MissingFileError)
    (tmp_path / "file").write_text("x")
    user_error(lambda: LLM(str(tmp_path / "file")), "is a file", kind=MissingFileError)
    no_weights = broken_copy(tiny_target, tmp_path / "w")
    (Path(no_weights) / "model.safetensors").unlink()
    user_error(lambda: LLM(no_weights), "no safetensors weights", kind=MissingFileError)
    (Path(no_weights) / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    user_error(lambda: LLM(no_weights), "model-00001-of-00002.safetensors", "incomplete download",
               kind=MissingFileError)


def test_a_drafter_given_as_the_target_says_so(heads):
    user_error(lambda: LLM(heads["eagle3"]), "this is a drafter checkpoint",
               "speculative_config.model")


# ---- drafters -------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["eagle3", "eagle", "mlp_speculator", "draft_model"])
def test_truncated_drafter_weights_name_the_file(tiny_target, heads, tmp_path, method):
    src = tiny_target if method == "draft_model" else heads[method]
    bad = broken_copy(src, tmp_path / "h", truncate=-7)
    user_error(lambda: LLM(tiny_target, speculative_config=spec(method, bad)),
               Path(bad) / "model.safetensors", "truncated or corrupt", kind=FileFormatError)


@pytest.mark.parametrize("method", ["eagle3", "eagle", "mlp_speculator", "draft_model"])
def test_drafter_config_not_json_names_the_file(tiny_target, heads, tmp_path, method):
    src = tiny_target if method == "draft_model" else heads[method]
    bad = broken_copy(src, tmp_path / "h", config='{"hidden_size": 32,')
    user_error(lambda: LLM(tiny_target, speculative_config=spec(method, bad)),
               Path(bad) / "config.json", "is not valid JSON", kind=FileFormatError)


@pytest.mark.parametrize("served, made", [("eagle", "eagle3"), ("eagle3", "mlp_speculator"),
                                          ("draft_model", "eagle3"), ("eagle", "mlp_speculator")])
def test_wrong_method_names_the_right_one(tiny_target, heads, served, made):
    msg = user_error(lambda: LLM(tiny_target, speculative_config=spec(served, heads[made])),
                     f"use method {made!r}")
    assert heads[made] in msg


@pytest.mark.parametrize("method", ["eagle3", "eagle", "mlp_speculator"])
def test_drafter_for_another_target(tiny_target, foreign_heads, method):
    msg = user_error(lambda: LLM(tiny_target,
                                 speculative_config=spec(method, foreign_heads[method])))
    assert "96" in msg or "32" in msg, msg  # the target's vocab_size or hidden_size


def test_draft_model_with_another_vocabulary(tiny_target, make_tiny_llama):
    other = make_tiny_llama("draft64", vocab=64)
    user_error(lambda: LLM(tiny_target, speculative_config=spec("draft_model", other)),
               "vocab_size 64", "96")


def test_missing_drafter_directory(tiny_target, tmp_path):
    user_error(lambda: LLM(tiny_target, speculative_config=spec("eagle3", str(tmp_path / "no"))),
               tmp_path / "no", kind=MissingFileError)


# ---- tokenizer and helpers ------------------------------------------------------------------

def test_tokenizer_missing_or_broken(tiny_target, tmp_path):
    user_error(lambda: LLM(tiny_target, tokenizer=str(tmp_path)), "tokenizer=",
               "no tokenizer there", kind=MissingFileError)
    (tmp_path / "tokenizer.json").write_text("{broken")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    user_error(lambda: load_tokenizer(tmp_path), "cannot be loaded", kind=FileFormatError)


def test_read_safetensors_names_missing_tensors(heads):
    path = Path(heads["eagle"]) / "model.safetensors"
    assert "fc.weight" in read_safetensors(path)
    user_error(lambda: read_safetensors(path, ["nope"]), path, "lacks tensor(s) ['nope']",
               kind=FileFormatError)
