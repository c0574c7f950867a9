"""Killed, then resumed, nothing lost: real signals sent to real processes.

Training (``TinyLM`` of test_trainer.py), the offline feature cache and regeneration run in a
subprocess (tests/train/interrupt_runner.py, inside the entry point's error handling) and are
sent SIGINT, SIGTERM or SIGKILL partway; the rerun of the same command must end bit-identical
to an uninterrupted run, without redoing finished work and without leftover temporaries. The
signal is sent once the run reaches a marker (a file it writes, a temporary that appears), never
after a fixed sleep, so a slow machine only makes the tests slower.
"""

from __future__ import annotations

import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file

from infer.foundation.errors import Interrupted
from train import features as F
from train.checkpoint import IncompatibleCheckpoint, list_checkpoints, read_state
from train.regenerate import regenerate

from .conftest import chat_rows
from .interrupt_runner import (FEATURE_KW, REGEN_KW, TRAIN_KW, feature_spec, regen_config)
from .test_trainer import make_cfg, run, synthetic_rows

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("interrupt_runner.py")


def start(*args: str, **env: str) -> subprocess.Popen:
    environ = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen([sys.executable, str(RUNNER), *args], cwd=REPO, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(proc: subprocess.Popen, ready, timeout: float = 120):
    """Poll ``ready()`` until it returns something truthy (returned); fail if ``proc`` ends."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = ready()
        if found:
            return found
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (status {proc.returncode}) before the marker:\n{err}")
        time.sleep(0.005)
    proc.kill()
    pytest.fail("timed out waiting for the marker")


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob(".*") if ".tmp" in p.name or ".old-" in p.name)


# ---- training ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The exported drafter of the same run, in this process, never interrupted."""
    cfg = make_cfg(tmp_path_factory.mktemp("reference"), **TRAIN_KW)
    run(cfg, synthetic_rows(16), final=True)
    return load_file(cfg.final_dir / "model.safetensors")


def interrupt_at(out: Path, step: int, signum: int) -> tuple[int, str, str]:
    """Run the training command, send ``signum`` while step ``step`` has just finished."""
    proc = start("train", str(out), PAUSE_AT=str(step))
    wait_for(proc, lambda: (out / "paused-0").exists())
    proc.send_signal(signum)
    (out / "go").touch()
    result = finish(proc)
    (out / "paused-0").unlink()
    (out / "go").unlink()
    return result


def assert_saved_and_said(result, out: Path, signum: int, step: int) -> None:
    """Exit 128 + signal, one line naming the checkpoint of ``step``, no traceback."""
    status, _, err = result
    ckpt = out / "t" / "checkpoints" / f"step_{step:08d}"
    name = signal.Signals(signum).name
    assert status == 128 + signum, err
    assert "Traceback" not in err, err
    said = [line for line in err.splitlines() if str(ckpt) in line]
    assert said == [f"train.py: interrupted by {name} at step {step}; checkpoint saved to "
                    f"{ckpt}; rerun the same command to resume"], err
    assert f"{name} received: stopping after this optimizer step" in err  # said at once
    assert read_state(ckpt)["step"] == step and not temporaries(out)


def test_sigint_then_sigterm_save_and_the_reruns_resume_exactly(tmp_path, uninterrupted):
    """The signal arrives during step N's hook: the stop comes at the next step boundary, where
    step N + 1 is checkpointed (no periodic checkpoints here: save_every=0)."""
    out = tmp_path / "run"
    first = interrupt_at(out, 2, signal.SIGINT)
    assert_saved_and_said(first, out, signal.SIGINT, 3)
    assert not (out / "t" / "final").exists()
    second = interrupt_at(out, 5, signal.SIGTERM)  # the same command again: resumes at step 3
    assert "resuming from" in second[1] and "(step 3)" in second[1]
    assert_saved_and_said(second, out, signal.SIGTERM, 6)
    status, stdout, err = finish(start("train", str(out)))
    assert status == 0 and "(step 6)" in stdout, err
    final = load_file(out / "t" / "final" / "model.safetensors")
    assert final.keys() == uninterrupted.keys()
    for k, v in uninterrupted.items():
        assert torch.equal(final[k], v), k


def test_sigkill_at_a_random_moment_leaves_a_loadable_checkpoint(tmp_path, uninterrupted):
    """Checkpoints every step, killed after a random delay (fixed seed) once step 1 is saved:
    mid-step or mid-checkpoint-write. The latest complete checkpoint loads; the rerun removes
    the killed write's temporaries and ends equal to the uninterrupted run."""
    out, delay = tmp_path / "run", random.Random(4).uniform(0.0, 0.3)
    proc = start("train", str(out), PAUSE_AT="1", SAVE_EVERY="1", STEP_SLEEP="0.05")
    wait_for(proc, lambda: (out / "paused-0").exists())
    (out / "go").touch()
    time.sleep(delay)
    proc.kill()
    assert finish(proc)[0] == -signal.SIGKILL  # it was still running: the kill hit the run
    latest = list_checkpoints(out / "t" / "checkpoints")[-1]
    assert read_state(latest)["step"] >= 1
    assert load_file(latest / "model.safetensors") and load_file(
        latest / "drafter" / "model.safetensors")
    status, stdout, err = finish(start("train", str(out), SAVE_EVERY="1"))
    assert status == 0, err
    assert not temporaries(out / "t")
    final = load_file(out / "t" / "final" / "model.safetensors")
    for k, v in uninterrupted.items():
        assert torch.equal(final[k], v), k


def test_in_process_signal_stops_at_the_next_boundary_and_restores_handlers(tmp_path):
    """Library use (no entry point): ``Interrupted`` reaches the caller, and the handlers that
    were installed before ``train`` are back afterwards."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    cfg = make_cfg(tmp_path, max_steps=6)
    with pytest.raises(Interrupted, match=r"SIGINT at step 3; checkpoint saved to .*step_00000003"
                       ) as stopped:
        run(cfg, synthetic_rows(12), _on_step=lambda s: s == 2 and os.kill(os.getpid(),
                                                                          signal.SIGINT))
    assert stopped.value.exit_status == 130
    assert {s: signal.getsignal(s) for s in before} == before
    assert [p.name for p in list_checkpoints(cfg.run_dir / "checkpoints")] == ["step_00000003"]


def test_ranks_agree_on_the_step_another_rank_was_signalled_at(tmp_path):
    """The stop votes ride on the step's one sync (``Meter.end_step``): when another rank votes
    SIGTERM in step 2's reduction, this rank, which received nothing, stops after step 2 too."""
    from train.trainer import make_accelerator

    cfg = make_cfg(tmp_path, max_steps=6)
    acc = make_accelerator(cfg.trainer, cfg.seed)
    real, syncs = acc.reduce, []

    def reduce(tensor, reduction="sum", scale=1.0):
        out = real(tensor, reduction, scale)
        if tensor.numel() == 6:  # loss, micro, tokens, grad norm, stop vote, SIGTERM vote
            syncs.append(tensor[4:].tolist())
            if len(syncs) == 2:
                out = out + torch.tensor([0, 0, 0, 0, 1, 1])  # the other rank's votes
        return out

    acc.reduce = reduce
    with pytest.raises(Interrupted, match="SIGTERM at step 2; checkpoint saved") as stopped:
        run(cfg, synthetic_rows(12), accelerator=acc)
    assert stopped.value.signum == signal.SIGTERM and syncs == [[0.0, 0.0], [0.0, 0.0]]
    assert [p.name for p in list_checkpoints(cfg.run_dir / "checkpoints")] == ["step_00000002"]


@pytest.mark.slow
def test_sigterm_to_one_of_two_ranks_stops_both_at_the_same_step(tmp_path):
    """``accelerate launch`` with two CPU processes (gloo); only rank 1 is signalled, while
    both wait after step 2. Both stop after step 3 (rank 1's vote in that step's sync), the
    checkpoint of step 3 is complete (both ranks' RNG states), each rank says so."""
    from .test_trainer import _free_port

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "conf/accelerate/cpu_2proc.yaml"), "--main_process_port",
           str(_free_port()), str(RUNNER), "train", str(out)]
    environ = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
               "ACCELERATE_LOG_LEVEL": "error", "PAUSE_AT": "2"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(proc, lambda: all((out / f"paused-{r}").exists() for r in (0, 1)), timeout=180)
    os.kill(int((out / "paused-1").read_text()), signal.SIGTERM)
    (out / "go").touch()
    status, _, err = finish(proc)
    assert status != 0 and "trainer.py" not in err, err  # torchrun's own traceback only
    ckpt = out / "t" / "checkpoints" / "step_00000003"
    said = f"interrupted by SIGTERM at step 3; checkpoint saved to {ckpt}"
    assert said in err, err  # (rank 0's line too, unless torchrun's SIGTERM overtakes it)
    # save_every=0: step 3 is saved only by a stop, and saving is collective, so rank 0, never
    # signalled, stopped at the same step (its RNG state is in the checkpoint)
    assert list_checkpoints(ckpt.parent) == [ckpt]
    assert {p.name for p in ckpt.glob("random_states_*.pkl")} == {"random_states_0.pkl",
                                                                 "random_states_1.pkl"}


def test_resuming_with_another_batch_geometry_is_refused(tmp_path):
    rows = synthetic_rows(8)
    run(make_cfg(tmp_path, max_steps=2, micro_batch_size=2), rows)
    for key, value in (("micro_batch_size", 4), ("grad_accum", 2)):
        cfg = make_cfg(tmp_path, max_steps=3, **{"micro_batch_size": 2, key: value})
        with pytest.raises(IncompatibleCheckpoint, match=rf"step_00000002.*'trainer\.{key}': "
                                                         r"checkpoint has \d, this run has "
                                                         rf"{value}.*trainer\.resume=never"):
            run(cfg, rows)


@pytest.mark.parametrize("umask,dirs,files", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_checkpoints_and_final_get_the_umask_permissions(tmp_path, umask, dirs, files):
    """What others load (final/, checkpoints with accelerate's files) is as readable as the
    umask allows, not tempfile's 0700 / 0600."""
    old = os.umask(umask)
    try:
        cfg = make_cfg(tmp_path, max_steps=1)
        run(cfg, synthetic_rows(4), final=True)
    finally:
        os.umask(old)
    made = [cfg.run_dir, *cfg.run_dir.rglob("*")]
    assert len(made) > 10 and cfg.final_dir in made
    for p in made:
        assert stat.S_IMODE(p.stat().st_mode) == (dirs if p.is_dir() else files), p


# ---- offline feature cache ---------------------------------------------------------------------

@pytest.fixture
def forwards(monkeypatch) -> list[int]:
    """Target forwards of a cache build in this process (one entry each)."""
    calls, real = [], F.capture
    monkeypatch.setattr(F, "capture", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def build(train_data, cache: Path) -> Path:
    frozen = F.FrozenTarget(train_data.target_dir, "float32", "cpu")
    return F.build_feature_cache(frozen, train_data.dataset, feature_spec(), cache, **FEATURE_KW)


def shard_bytes(cache: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(cache.iterdir())}


def test_feature_cache_sigterm_then_sigkill_then_resume(train_data, tmp_path, forwards):
    """SIGTERM unwinds (the shard being written leaves no temporary), SIGKILL does not (its
    temporary stays); the rerun removes it, computes only the missing shards, and the cache is
    byte-identical to one built without interruption."""
    rows = tmp_path / "rows"
    train_data.dataset.save_to_disk(str(rows))
    cache, shards = tmp_path / "cache", -(-len(train_data.dataset) // FEATURE_KW["rows_per_shard"])
    assert shards >= 4
    args = ("features", str(rows), train_data.target_dir, str(cache))

    def complete() -> dict[str, int]:  # shard name -> mtime
        return {p.name: p.stat().st_mtime_ns for p in cache.glob("shard_*")}

    def writing_a_new_shard(done: dict[str, int]):  # a temporary of a shard not yet complete
        return [p for p in cache.glob(".shard_*.tmp-*") if p.name[1:24] not in done]

    proc = start(*args, SLOW="0.3")  # a shard's temporary lives >= 2 forwards: 0.6 s
    wait_for(proc, lambda: "shard_00000.safetensors" in complete() and writing_a_new_shard({}))
    proc.send_signal(signal.SIGTERM)
    status, _, err = finish(proc)
    assert status == 143 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == ("train.py: interrupted by SIGTERM; finished shards "
                                            "are kept")
    first = complete()
    assert not temporaries(cache) and 0 < len(first) < shards and sorted(
        p.name for p in cache.iterdir()) == sorted(first)  # no index.json: incomplete

    proc = start(*args, SLOW="0.3")
    wait_for(proc, lambda: writing_a_new_shard(first))
    proc.kill()
    finish(proc)
    done = {int(name[6:11]) for name in complete()}
    assert temporaries(cache) and len(done) < shards
    build(train_data, cache)
    assert not temporaries(cache)
    assert {k: v for k, v in complete().items() if k in first} == first  # never redone
    n, rps, bs = len(train_data.dataset), FEATURE_KW["rows_per_shard"], FEATURE_KW["batch_size"]
    assert len(forwards) == sum(-(-(min(n, (i + 1) * rps) - i * rps) // bs)  # missing ones only
                                for i in range(shards) if i not in done)
    fresh = build(train_data, tmp_path / "fresh")
    assert shard_bytes(cache) == shard_bytes(fresh)


def test_a_truncated_shard_is_detected_and_recomputed(train_data, tmp_path, forwards):
    cache = build(train_data, tmp_path / "cache")
    whole = shard_bytes(cache)
    shard = cache / "shard_00001.safetensors"
    shard.write_bytes(whole[shard.name][: len(whole[shard.name]) // 2])
    with pytest.raises(FileNotFoundError, match="missing or changed shards shard_00001"):
        F.CachedFeatureRows(cache, train_data.dataset)
    forwards.clear()
    with pytest.warns(UserWarning, match="recomputing unreadable shard .*shard_00001"):
        build(train_data, cache)
    assert len(forwards) == 2 and shard_bytes(cache) == whole


# ---- regeneration ------------------------------------------------------------------------------

def test_regeneration_killed_midway_resumes_without_redoing_chunks(tmp_path, train_target,
                                                                   monkeypatch):
    from infer import LLM

    data = tmp_path / "rows"
    datasets.Dataset.from_list(chat_rows(6, seed=1)).save_to_disk(str(data))
    out = tmp_path / "run"
    proc = start("regenerate", str(data), train_target, str(out), SLOW="0.5")
    wait_for(proc, lambda: (out / "chunk_00000.jsonl").exists())
    proc.kill()
    finish(proc)
    done = sorted(p.name for p in out.glob("chunk_*"))
    assert "chunk_00002.jsonl" not in done

    calls, real = [], LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, *a, **k: (
        calls.append(len(prompts)), real(self, prompts, *a, **k))[1])
    ds = datasets.load_from_disk(str(data))
    resumed = regenerate(ds, train_target, regen_config(), out, **REGEN_KW)
    assert calls == [2] * (3 - len(done))  # one call of 2 prompts per missing chunk
    assert not temporaries(out)
    fresh = regenerate(ds, train_target, regen_config(), tmp_path / "fresh", **REGEN_KW)
    assert resumed.to_list() == fresh.to_list()
    for name in ("chunk_00000.jsonl", "chunk_00001.jsonl", "chunk_00002.jsonl"):
        assert (out / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes()
