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
always complete, so a job killed while saving resumes from the previous one.

The fingerprint covers what makes a saved state meaningless for this run (drafter, objective,
data, target, seed, stage, batch geometry). Optimizer hyperparameters (lr, schedule, clipping,
step budget) are deliberately outside it: resuming a diverged run with a lower ``trainer.lr``, or
a finished one with a larger ``trainer.max_steps``, is a normal thing to do.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

from infer.atomic import atomic_dir, replace_dir
from train import fingerprint
from train.fingerprint import digest

STATE_FILE = "trainer_state.json"
DRAFTER_DIR = "drafter"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
# Sections of TrainConfig a checkpoint depends on, and the trainer keys that fix the batches.
_COMPAT_SECTIONS = ("target", "data", "regenerate", "drafter", "objective")
_COMPAT_TRAINER = ("micro_batch_size", "grad_accum")
_COMPAT_IGNORED = {"data.num_proc", "regenerate.batch_size"}  # speed only


class IncompatibleCheckpoint(ValueError):
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


def _as_dict(section: Any) -> Any:
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        return dataclasses.asdict(section)
    try:  # OmegaConf DictConfig
        from omegaconf import OmegaConf

        if OmegaConf.is_config(section):
            return OmegaConf.to_container(section, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return section


def compat_config(cfg: Any, stage: str, world_size: int) -> dict[str, Any]:
    """Flat ``{"section.key": value}`` of everything a resumable state depends on."""
    out: dict[str, Any] = {"stage": stage, "seed": getattr(cfg, "seed", None),
                           "num_processes": world_size}
    for name in _COMPAT_SECTIONS:
        section = _as_dict(getattr(cfg, name, None))
        for key, value in sorted((section or {}).items()):
            if f"{name}.{key}" not in _COMPAT_IGNORED:
                out[f"{name}.{key}"] = value
    for key in _COMPAT_TRAINER:
        out[f"trainer.{key}"] = getattr(cfg.trainer, key)
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
    raise FileNotFoundError(
        f"trainer.resume={resume!r}: no checkpoint there (expected a folder with {STATE_FILE}, "
        f"e.g. {root / step_dir_name(100)}, or one holding step_N folders); use "
        "trainer.resume=auto (latest of this run) or trainer.resume=never (start over)")


def check_compatible(path: Path, state: dict[str, Any], compat: dict[str, Any]) -> None:
    """Raise ``IncompatibleCheckpoint`` naming the path, the differing keys and the way out."""
    if state.get("fingerprint") == digest(compat):
        return
    fingerprint.check(state.get("compat", {}), compat, subject=f"checkpoint {path}",
                      held="checkpoint has", error=IncompatibleCheckpoint, remedy=(
                          "Restore those settings to resume from it, or start over with "
                          "trainer.resume=never (replaces this stage's checkpoints) or a "
                          "different output_dir / name."))


def remove_checkpoints(root: Path) -> list[Path]:
    """Delete every checkpoint (and leftover temporary folder) of one stage; main process."""
    removed = list_checkpoints(root)
    for p in removed:
        shutil.rmtree(p)
    remove_temporaries(root)
    return removed


def remove_temporaries(root: Path) -> None:
    """Folders of killed writes: ``.tmp-step_N`` (being written) and ``.step_N.old-*`` (an
    earlier run's same-step checkpoint, moved aside by ``replace_dir``)."""
    if root.is_dir():
        for p in [*root.glob(".tmp-step_*"), *root.glob(".step_*.old-*")]:
            shutil.rmtree(p, ignore_errors=True)


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` checkpoints of this stage (0 or less keeps all)."""
    if keep_last > 0:
        for p in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(p, ignore_errors=True)


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
        replace_dir(tmp, final)  # over a previous run's checkpoint of this step (resume=never)
    accelerator.wait_for_everyone()
    return final


def export_atomically(objective, state_dict: dict | None, dest: str | Path) -> Path:
    """``objective.export`` into a temporary sibling, then swap it in: ``dest`` is never half
    written, and a served drafter is replaced only by a complete one. Main process only."""
    with atomic_dir(dest) as tmp:
        objective.export(tmp, state_dict)
    return Path(dest)
