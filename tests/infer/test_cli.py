"""``python infer.py``'s pieces: the prompts file and the mode check."""

import json

import pytest

from infer.cli import check_mode, read_prompts
from infer.config import InferConfig, Mode


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
    with pytest.raises(ValueError, match=r"invalid value for 'mode': 'serve'; expected one of "
                                         r"generate \| eval"):
        check_mode(InferConfig(mode="serve"))
