"""Training checkpoints: atomic writes, discovery, pruning, compatibility, atomic export.

Layout (one folder per stage; ``main`` directly under ``checkpoints``)::

    <run_dir>/checkpoints/step_00000200/          stage "main"
    <run_dir>/checkpoints/stage2/step_00000050/   any other stage
        model.safetensors, optimizer.bin, scheduler.bin, random_states_<rank>.pkl
                                  accelerator.save_state (DeepSpeed / FSDP: their own shards)
        drafter/                  the deployment-format drafter (Objective.export), servable
        trainer_state.json        step, epoch position, tokens, stage, config fingerprint

A checkpoint is written into ``.tmp-step_N`` and renamed by the main process once every rank has
written its part, and ``trainer_state.json`` is its last file: a folder named ``step_N`` is
always complete, so a job killed while saving resumes from the previous one. What such a kill
leaves (``.tmp-step_N``, a pruned or replaced checkpoint moved aside as ``.step_N.old-*``) is
deleted by the main process when the next run of the stage starts (``remove_temporaries``).
Files and folders get the umask's permissions (``umask_modes``: safetensors writes 0600 files),
so a checkpoint is as readable as its folder.

The fingerprint covers what makes a saved state meaningless for this run (drafter, objective,
data, target, regeneration, the features the objective sees, seed, stage, batch geometry): the
settings declared ``resume=True`` beside their fields (train/config.py, train/methods/);
``regenerate.batch_size`` only when answers are sampled (it changes them then), the feature
dtype only when features are cached. Optimizer hyperparameters (lr, schedule, clipping, step
budget) and the device are deliberately outside it: resuming a diverged run with a lower
``trainer.lr``, or a finished one with a larger ``trainer.max_steps``, is a normal thing to do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer.foundation.atomic import (atomic_dir, remove_leftovers, replace_dir, temp_path,
                                     umask_modes)
from infer.foundation.errors import ConfigError, FileFormatError, MissingFileError
from train import fingerprint
from train.fingerprint import digest
from train.choices import FeatureMode
from train.methods.base import METHODS
from train.regenerate import batch_size_matters

if TYPE_CHECKING:
    from train.config import TrainConfig

STATE_FILE = "trainer_state.json"
DRAFTER_DIR = "drafter"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class IncompatibleCheckpoint(ConfigError):
    """The checkpoint to resume from was written by a run with different settings."""


def checkpoint_root(run_dir: str | Path, stage: str) -> Path:
    root = Path(run_dir) / "checkpoints"
    return root if stage == "main" else root / stage


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root`` (folders ``step_N`` holding the state file), by step."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if _STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _pinned(section: Any, prefix: str = "") -> dict[str, Any]:
    """``{"section.key": value}`` of every setting declared ``resume=True`` (its ``setting``
    metadata, beside the field) in ``section`` and the sections nested in it."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_pinned(value, f"{prefix}{f.name}."))
        elif f.metadata.get("resume"):
            out[f"{prefix}{f.name}"] = value
    return out


def compat_config(cfg: TrainConfig, stage: str, world_size: int) -> dict[str, Any]:
    """Flat ``{"section.key": value}`` of everything a resumable state depends on: the settings
    declared ``resume=True``, less two that matter only sometimes (the regeneration's batch
    size when its answers are greedy, the feature dtype when features are not cached)."""
    out: dict[str, Any] = {"stage": stage, "num_processes": world_size, **_pinned(cfg)}
    if not batch_size_matters(cfg.regenerate):  # greedy: the same answers at any batch size
        del out["regenerate.batch_size"]
    if cfg.features.mode != FeatureMode.offline:
        del out["features.dtype"]
    return json.loads(json.dumps(out, default=str))  # plain JSON values (tuples -> lists)


def read_state(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / STATE_FILE).read_text())


def resolve_resume(resume: str, root: Path) -> Path | None:
    """``trainer.resume`` -> the checkpoint folder to load, or None to start from scratch.

    ``auto``: the latest complete checkpoint of this stage, if any; ``never``: None; anything else
    is a path to a checkpoint folder (or to a folder of them: its latest is taken).
    """
    if resume == "never":
        return None
    if resume == "auto":
        found = list_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if (path / STATE_FILE).is_file():
        return path
    found = list_checkpoints(path)
    if found:
        return found[-1]
    raise MissingFileError(
        f"trainer.resume={resume!r}: no checkpoint there (expected a folder with {STATE_FILE}, "
        f"e.g. {root / step_dir_name(100)}, or one holding step_N folders); use "
        "trainer.resume=auto (latest of this run) or trainer.resume=never (start over)")


def check_compatible(path: Path, state: dict[str, Any], compat: dict[str, Any]) -> None:
    """Raise ``IncompatibleCheckpoint`` naming the path, the differing keys and the way out.
    A key a checkpoint's record lacks (written before the setting existed) counts as the
    setting's default, so old checkpoints resume as long as new settings stay at theirs."""
    if state.get("fingerprint") == digest(compat):
        return
    saved = {**_defaults(compat), **state.get("compat", {})}
    fingerprint.check(saved, compat, keys=compat, subject=f"checkpoint {path}",
                      held="checkpoint has", error=IncompatibleCheckpoint, remedy=(
                          "Restore those settings to resume from it, or start over with "
                          "trainer.resume=never (replaces this stage's checkpoints) or a "
                          "different output_dir / name."))


def _defaults(compat: dict[str, Any]) -> dict[str, Any]:
    """The compat record of the default settings (of ``compat``'s method), for its keys."""
    from train.config import TrainConfig

    drafter = METHODS.get(compat["drafter.method"])
    default = compat_config(TrainConfig(drafter=drafter(), objective=drafter.objective_config()),
                            str(compat.get("stage")), compat.get("num_processes"))
    return {k: v for k, v in default.items() if k in compat}


def check_unpickled_shards(accelerator, path: Path, root: Path) -> None:
    """Under DeepSpeed (its checkpoint engine loads with ``weights_only=False``) and FSDP
    (torch reads a sharded checkpoint's ``.metadata`` with plain ``pickle``), resuming runs
    whatever code the checkpoint's pickles hold; neither library offers a safe mode. So only
    this run's own checkpoints (under ``root``, written by this run) are resumed there; a folder
    from elsewhere is refused with the reason, for the user to decide."""
    from accelerate.utils import DistributedType

    unsafe = (DistributedType.DEEPSPEED, DistributedType.FSDP)
    if accelerator.distributed_type not in unsafe or path.resolve().is_relative_to(root.resolve()):
        return
    raise ConfigError(
        f"trainer.resume={str(path)!r}: under {accelerator.distributed_type.value} a checkpoint is "
        "read with pickle (DeepSpeed loads with weights_only=False, FSDP's .metadata is a "
        "pickle), which runs any code the files hold, so only this run's own checkpoints "
        f"({root}) are resumed. If you trust that folder, copy it into {root} and use "
        "trainer.resume=auto")


def load_state(accelerator, path: Path) -> None:
    """``accelerator.load_state(path)`` that loads weights only, or refuses the checkpoint.

    A checkpoint folder is a file anyone can hand over (``trainer.resume=PATH``), and
    ``optimizer.bin``, ``scheduler.bin`` and ``random_states_<rank>.pkl`` are pickles: accelerate
    (>= 1.1, pyproject.toml) reads them with ``weights_only=True``, so a pickle that would run
    code fails instead. A refused optimizer or scheduler surfaces here as one error naming the
    folder. A refused (or missing) RNG file accelerate only logs and resumes with the wrong RNG
    (a silently inexact resume, the tampering unnoticed), so that file is read first, the same
    way (``accelerate.utils.load``: weights_only, numpy's RNG types allowed), and refused by name.
    DeepSpeed and FSDP shards are read by their own loaders, not through these calls.
    """
    import pickle

    from accelerate.utils import load as weights_only_load

    rng = path / f"random_states_{accelerator.process_index}.pkl"
    if not rng.is_file():
        raise MissingFileError(f"checkpoint {path}: {rng.name} is missing, so the random state "
                               "cannot be restored; resume from another checkpoint or start over "
                               "with trainer.resume=never")
    try:
        weights_only_load(rng)
    except Exception as err:  # noqa: BLE001 - refused global, truncated, not a pickle: unusable
        raise _refused(path, rng.name, err) from None
    try:
        accelerator.load_state(str(path))
    except pickle.UnpicklingError as err:
        raise _refused(path, "one of its pickles (optimizer.bin, scheduler.bin ...)", err) from None


def _refused(path: Path, what: str, err: Exception) -> FileFormatError:
    """The error naming the file; torch's own message opens with advice to load with
    ``weights_only=False`` (exactly what must not happen here), so only its reason is kept."""
    reasons = [line.strip() for line in str(err).splitlines()
               if line.strip() and not line.startswith("Weights only load failed")]
    reason = (reasons or [type(err).__name__])[0][:200]
    return FileFormatError(
        f"checkpoint {path}: {what} cannot be loaded as weights only (weights_only=True: "
        f"{reason}); it is not a state this trainer wrote, or it is damaged. Resume from "
        "another checkpoint, or start over with trainer.resume=never")


def remove_checkpoints(root: Path) -> list[Path]:
    """Delete every checkpoint of one stage; main process, after ``remove_temporaries``."""
    removed = list_checkpoints(root)
    for p in removed:
        _delete(p)
    return removed


def _delete(path: Path) -> None:
    """Rename a checkpoint aside, then delete it: a kill midway never leaves a ``step_N``
    folder that still has its state file but lacks weights (``remove_temporaries`` finishes)."""
    aside = temp_path(path, "old")
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def remove_temporaries(root: Path) -> None:
    """Folders of killed writes: ``.tmp-step_N`` (being written) and ``.step_N.old-*`` (an
    earlier run's same-step checkpoint moved aside by ``replace_dir``, or one being deleted).
    Main process, before any rank writes checkpoints of this stage."""
    if root.is_dir():
        for p in [*root.glob(".tmp-step_*"), *root.glob(".step_*.old-*")]:
            shutil.rmtree(p, ignore_errors=True)


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` checkpoints of this stage (0 or less keeps all)."""
    if keep_last > 0:
        for p in list_checkpoints(root)[:-keep_last]:
            _delete(p)


def save_checkpoint(accelerator, model, objective, root: Path, state: dict[str, Any]) -> Path:
    """Write ``root/step_N`` atomically; every rank must call it (collective saves).

    ``model``: the prepared objective (for the sharded state), ``objective``: the plain module
    whose ``export`` writes the servable drafter from the gathered state dict.
    """
    name = step_dir_name(state["step"])
    tmp, final = root / f".tmp-{name}", root / name
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)  # tied weights: deduplicated
    state_dict = accelerator.get_state_dict(model)  # collective under ZeRO-3 / FSDP
    if accelerator.is_main_process:
        objective.export(tmp / DRAFTER_DIR, state_dict)
    accelerator.wait_for_everyone()  # every rank's RNG / shard files are in tmp
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
        umask_modes(tmp)  # safetensors writes 0600 files: readable as the umask allows
        replace_dir(tmp, final)  # over a previous run's checkpoint of this step (resume=never)
    accelerator.wait_for_everyone()
    return final


def export_atomically(objective, state_dict: dict | None, dest: str | Path) -> Path:
    """``objective.export`` into a temporary sibling, then swap it in: ``dest`` is never half
    written, and a served drafter is replaced only by a complete one. Main process only: it
    first deletes what killed exports of ``dest`` left beside it."""
    remove_leftovers(dest)
    with atomic_dir(dest) as tmp:
        objective.export(tmp, state_dict)
    return Path(dest)
