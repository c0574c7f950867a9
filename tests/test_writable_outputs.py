"""Output locations are checked before any work starts: a long generation, evaluation or
training run never ends by losing its results to a permission error.

Tests run as root here, where every permission bit is ignored, so an unwritable place is made
the way that stops root too: a path below a regular file.
"""

import os

import pytest

from infer.cli import check_outputs as check_infer_outputs
from infer.cli import run as generate
from infer.config import InferConfig
from infer.foundation.errors import NotWritableError
from train.config import TrainConfig
from train.pipeline import check_outputs as check_train_outputs
from train.pipeline import run as train


@pytest.fixture
def blocked(tmp_path):
    """A path under which nothing can be created (its parent is a file)."""
    (tmp_path / "file").write_text("x")
    return tmp_path / "file" / "below"


def test_infer_outputs(tmp_path, blocked):
    check_infer_outputs(InferConfig(output=str(tmp_path / "new" / "out.jsonl")))  # creatable
    check_infer_outputs(InferConfig(mode="eval"))  # default outputs/eval
    with pytest.raises(NotWritableError, match=rf"output='{blocked}/r.jsonl': cannot create"):
        check_infer_outputs(InferConfig(output=str(blocked / "r.jsonl")))
    with pytest.raises(NotWritableError, match="output=.* is a directory"):
        check_infer_outputs(InferConfig(output=str(tmp_path)))
    cfg = InferConfig(mode="eval")
    cfg.eval.output_dir = str(blocked)
    with pytest.raises(NotWritableError, match="eval.output_dir="):
        check_infer_outputs(cfg)
    with pytest.raises(NotWritableError, match="output="):  # before the model is looked at
        generate(InferConfig(output=str(blocked / "r.jsonl")), "/no/such/model", ["x"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_directory_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(NotWritableError, match="output="):
        check_infer_outputs(InferConfig(output=str(ro / "out.jsonl")))


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs sysfs")
def test_a_read_only_filesystem_is_refused_even_for_root(tmp_path):
    """sysfs takes no new files from anyone, though ``os.access`` says root may write there:
    the check creates a file to know, in infer.py and train.py alike."""
    with pytest.raises(NotWritableError, match=r"output='/sys/out.jsonl': cannot create files"):
        check_infer_outputs(InferConfig(output="/sys/out.jsonl"))
    with pytest.raises(NotWritableError, match=r"output_dir='/sys/runs/tiny_eagle3': cannot create"):
        check_train_outputs(TrainConfig(output_dir="/sys/runs"))
    existing = tmp_path / "out.jsonl"
    existing.write_text("kept\n")
    check_infer_outputs(InferConfig(output=str(existing)))  # probed without being changed
    assert existing.read_text() == "kept\n" and os.listdir(tmp_path) == ["out.jsonl"]


def test_train_outputs(tmp_path, blocked):
    check_train_outputs(TrainConfig(output_dir=str(tmp_path / "new")))
    with pytest.raises(NotWritableError, match=r"output_dir=.*cannot create files under"):
        check_train_outputs(TrainConfig(output_dir=str(blocked)))
    cfg = TrainConfig(output_dir=str(tmp_path))
    cfg.features.cache_dir = str(blocked)
    with pytest.raises(NotWritableError, match="features.cache_dir="):
        check_train_outputs(cfg)
    cfg = TrainConfig(output_dir=str(blocked))
    cfg.target.path = "/no/such/target"
    with pytest.raises(NotWritableError, match="output_dir="):  # before the target is looked at
        train(cfg)
