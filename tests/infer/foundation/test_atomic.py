"""Atomic writes: the destination holds the old content or the new, never a part, and readable
permissions; killed writes leave temporaries that ``remove_leftovers`` finds."""

import os
import stat

import pytest

from infer.foundation.atomic import (atomic_dir, atomic_file, remove_leftovers, temp_path,
                                     write_text)


def test_write_text_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "out.json"
    write_text(path, "one")
    write_text(path, "two")
    assert path.read_text() == "two"
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "out.txt"
    write_text(path, "old")
    with pytest.raises(RuntimeError):
        with atomic_file(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed midway")
    assert path.read_text() == "old" and sorted(tmp_path.iterdir()) == [path]


def test_files_and_dirs_get_the_umask_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        write_text(tmp_path / "f", "x")
        with atomic_dir(tmp_path / "d") as tmp:
            (tmp / "w").write_text("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o755  # not tempfile's 0700


def test_atomic_dir_swaps_or_merges(tmp_path):
    dest = tmp_path / "ckpt"
    with atomic_dir(dest) as tmp:
        (tmp / "a").write_text("1")
        (tmp / "keep").write_text("k")
    with atomic_dir(dest) as tmp:  # swap: the old directory is gone whole
        (tmp / "a").write_text("2")
    assert sorted(p.name for p in dest.iterdir()) == ["a"]
    (dest / "other").write_text("o")
    with atomic_dir(dest, merge=["a", "b"]) as tmp:  # merge: others stay
        (tmp / "a").write_text("3")
        (tmp / "b").write_text("4")
    assert {p.name: p.read_text() for p in dest.iterdir()} == {"a": "3", "b": "4", "other": "o"}
    with pytest.raises(KeyError):
        with atomic_dir(dest) as tmp:
            (tmp / "a").write_text("lost")
            raise KeyError("crash")
    assert (dest / "a").read_text() == "3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_remove_leftovers(tmp_path):
    dest = tmp_path / "shard.safetensors"
    stale = [temp_path(dest), temp_path(dest, "old")]
    stale[0].write_text("partial")
    stale[1].mkdir()
    (tmp_path / "unrelated").write_text("u")
    assert sorted(remove_leftovers(dest)) == sorted(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated"]


def test_leftovers_of_live_writers_are_kept(tmp_path):
    """A temporary named after a live process (another job on this host) or being written by
    this one is not a leftover; one named after this pid but not being written is (a container
    gives every run the same pid); a glob names a family; foreign names are never touched."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    live, mine = str(os.getppid()), str(os.getpid())
    names = {f".chunk_00001.jsonl.tmp-{dead}-0123abcd": False,
             f".chunk_00002.jsonl.tmp-{mine}-0123abcd": False,
             f".chunk_00003.jsonl.tmp-{live}-0123abcd": True,
             f"..final.tmp-{mine}-0123abcd.tmp-{dead}-89abcdef": False,  # atomic_dir(merge)'s
             ".chunk_00004.jsonl.tmp-notours": True, "chunk_00000.jsonl": True}
    for name in names:
        (tmp_path / name).write_text("x")
    with atomic_file(tmp_path / "chunk_00005.jsonl") as writing:
        writing.write_text("in progress")
        remove_leftovers(tmp_path / "chunk_*.jsonl")
        remove_leftovers(tmp_path / "final")
        assert writing.exists()
    kept = {name for name, keep in names.items() if keep} | {"chunk_00005.jsonl"}
    assert {p.name for p in tmp_path.iterdir()} == kept


@pytest.mark.parametrize("umask,dirs,files", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_files_written_through_tempfile_get_the_umask_permissions(tmp_path, umask, dirs, files):
    """safetensors' save_file writes through a 0600 temporary; what lands follows the umask."""
    import torch
    from safetensors.torch import save_file

    old = os.umask(umask)
    try:
        with atomic_dir(tmp_path / "ckpt") as tmp:
            (tmp / "sub").mkdir()
            save_file({"w": torch.zeros(2)}, str(tmp / "sub" / "model.safetensors"))
        with atomic_file(tmp_path / "v.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp))
    finally:
        os.umask(old)
    for p in (tmp_path / "ckpt", tmp_path / "ckpt" / "sub"):
        assert stat.S_IMODE(p.stat().st_mode) == dirs, p
    for p in (tmp_path / "ckpt" / "sub" / "model.safetensors", tmp_path / "v.safetensors"):
        assert stat.S_IMODE(p.stat().st_mode) == files, p
