"""The one dataset reader behind training data and evaluation prompts: every local layout either
side accepted, read through ``datasets`` (no network)."""

import json

import datasets
import pytest

from infer.data_sources import ROLES, load_source

ROWS = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}]


def test_files_of_every_kind(tmp_path):
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    (tmp_path / "list.json").write_text(json.dumps(ROWS))
    (tmp_path / "obj.json").write_text(json.dumps({"test": ROWS[:1], "data": ROWS}))
    datasets.Dataset.from_list(ROWS).to_csv(str(tmp_path / "r.csv"))
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "r.parquet"))
    for name in ("r.jsonl", "list.json", "r.csv", "r.parquet"):
        assert load_source(tmp_path / name).to_list() == ROWS, name
    assert load_source(tmp_path / "obj.json", "test").to_list() == ROWS[:1]  # the split's list
    assert load_source(tmp_path / "obj.json", "train").to_list() == ROWS  # then "data"


def test_folders(tmp_path):
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "train.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    (folder / "test.jsonl").write_text(json.dumps(ROWS[1]) + "\n")
    assert load_source(folder, "test").to_list() == ROWS[1:]
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(saved))
    assert load_source(saved).to_list() == ROWS
    with pytest.raises(ValueError, match=r"has splits \['train'\]; split='test'"):
        load_source(saved, "test")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        load_source(tmp_path / "empty")


def test_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        load_source(bad)
    (tmp_path / "cols.json").write_text(json.dumps({"prompt": ["a"], "completion": ["b"]}))
    with pytest.raises(ValueError, match=r"cols\.json: expected a list of records.*'data'"):
        load_source(tmp_path / "cols.json")
    (tmp_path / "rows.txt").write_text("x\n")
    with pytest.raises(ValueError, match=r"rows\.txt.*'\.txt'"):
        load_source(tmp_path / "rows.txt")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_source(tmp_path / "nope.jsonl")


def test_sharegpt_roles_map_to_openai_roles():
    assert [ROLES[r] for r in ("human", "gpt", "chatgpt", "model", "system")] == [
        "user", "assistant", "assistant", "assistant", "system"]
