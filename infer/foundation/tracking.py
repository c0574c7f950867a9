"""Experiment tracking: one small ``Logger`` interface, a W&B implementation and a no-op twin.

Training and the acceptance harness log through the same interface, so training accuracy and
serving acceptance land on one dashboard under the same key suffixes (``log_acceptance``)::

    logger = make_logger("wandb", rank=rank, project="draftsmith", name="eagle3-llama8b",
                         config=cfg_dict, dir="outputs/run")
    logger.log({"train/loss": 1.23}, step=100)
    logger.log_acceptance("eval/eagle3", harness_row_or_spec_metrics, step=100)
    logger.log_table("eval/results", ["method", "k", "speedup"], [["eagle3", 3, 2.1]])
    logger.log_image("eval/speedup_vs_k", "outputs/eval/speedup_vs_k.png")
    logger.finish()

``make_logger`` returns a ``NoopLogger`` on every rank but 0 and for ``kind="none"``, so callers
never branch on the rank. ``WandbLogger`` never needs the network to start: it runs offline when
``WANDB_MODE=offline`` or when no API key is configured (``WANDB_API_KEY`` unset and no netrc entry
for the W&B host), and falls back to offline when an online start fails or times out (after
``init_timeout`` seconds). Offline runs sit in ``<dir>/wandb/offline-run-*``; upload them later
with ``wandb sync``. ``read_wandb_file`` reads such a run's ``.wandb`` file back (history and
summary records), for tests and for inspecting offline runs without the network; W&B's service
finishes writing that file asynchronously, so it waits for the run's final record.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import netrc
import os
import struct
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence
from urllib.parse import urlparse

from infer.foundation.validation import config_error

log = logging.getLogger(__name__)

LOGGER_KINDS = ("wandb", "none")


class Logger:
    """The interface. Subclasses implement ``log``, ``log_table``, ``log_image``, ``finish``."""

    def log(self, data: Mapping[str, Any], step: int | None = None) -> None:
        raise NotImplementedError

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                  step: int | None = None) -> None:
        raise NotImplementedError

    def log_image(self, name: str, path: str | os.PathLike, step: int | None = None,
                  caption: str | None = None) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def log_acceptance(self, prefix: str, metrics: Any, step: int | None = None) -> dict:
        """Log acceptance metrics under ``prefix``; returns the flat dict that was logged.

        ``metrics``: a ``SpecMetrics``, its ``as_dict()``, a harness ``ConfigResult`` (or its
        dict), or a training dict with ``per_position`` (per-TTT-step accuracies). Keys written
        (one dashboard for training and serving): ``{prefix}/acceptance_length``,
        ``{prefix}/acceptance_rate``, ``{prefix}/per_position/{i}`` and every other finite
        numeric top-level value as ``{prefix}/{key}``.
        """
        flat = acceptance_scalars(prefix, metrics)
        self.log(flat, step=step)
        return flat

    def __enter__(self) -> "Logger":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


class NoopLogger(Logger):
    """Does nothing: tests, non-zero ranks and ``logger=none``."""

    def log(self, data, step=None) -> None:
        pass

    def log_table(self, name, columns, rows, step=None) -> None:
        pass

    def log_image(self, name, path, step=None, caption=None) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger(Logger):
    """Weights & Biases; offline unless an API key is configured (see the module docstring).

    ``mode``: None (decide as above), "online", "offline" or "disabled". Extra keyword arguments
    go to ``wandb.init`` (group, tags, job_type ...).
    """

    def __init__(self, project: str = "draftsmith", name: str | None = None,
                 config: Mapping[str, Any] | None = None, dir: str | os.PathLike | None = None,
                 mode: str | None = None, init_timeout: float = 30.0, **init_kwargs: Any) -> None:
        import wandb

        self._wandb = wandb
        self.mode = resolve_wandb_mode(mode)
        if dir is not None:
            Path(dir).mkdir(parents=True, exist_ok=True)
        kwargs = dict(project=project, name=name, config=dict(config or {}),
                      dir=None if dir is None else str(dir), reinit="finish_previous",
                      **init_kwargs)
        try:
            self.run = wandb.init(mode=self.mode, settings=_settings(wandb, init_timeout), **kwargs)
        except Exception as e:  # noqa: BLE001 (any failure to reach W&B: keep the run locally)
            if self.mode != "online":
                raise
            log.warning("wandb online start failed (%s); logging offline instead", e)
            self.mode = "offline"
            self.run = wandb.init(mode="offline", settings=_settings(wandb, init_timeout),
                                  **kwargs)
        self._finished = False

    @property
    def dir(self) -> str:
        """The run's local files directory (``.../wandb/<run>/files``)."""
        return self.run.dir

    def log(self, data, step=None) -> None:
        self.run.log(dict(data), step=step)

    def log_table(self, name, columns, rows, step=None) -> None:
        table = self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])
        self.run.log({name: table}, step=step)

    def log_image(self, name, path, step=None, caption=None) -> None:
        self.run.log({name: self._wandb.Image(str(path), caption=caption)}, step=step)

    def finish(self) -> None:
        if not self._finished:
            self._finished = True
            self.run.finish()


def make_logger(kind: str = "none", rank: int = 0, **kwargs: Any) -> Logger:
    """``WandbLogger(**kwargs)`` on rank 0 for ``kind="wandb"``; a ``NoopLogger`` otherwise."""
    if kind not in LOGGER_KINDS:
        raise config_error("logger", kind, f"one of {', '.join(LOGGER_KINDS)}", "make_logger")
    if kind == "none" or rank != 0:
        return NoopLogger()
    return WandbLogger(**kwargs)


# ---- helpers --------------------------------------------------------------------------------

def acceptance_scalars(prefix: str, metrics: Any) -> dict[str, float]:
    """The flat ``{prefix}/...`` scalars ``Logger.log_acceptance`` writes (see there)."""
    if hasattr(metrics, "as_dict"):
        metrics = metrics.as_dict()
    elif dataclasses.is_dataclass(metrics) and not isinstance(metrics, type):
        metrics = dataclasses.asdict(metrics)
    m = dict(metrics)
    length = m.pop("acceptance_length", m.pop("mean_acceptance_length", None))
    rates = m.pop("per_position", m.pop("per_position_rates", None))
    out: dict[str, float] = {}
    if length is not None:
        out[f"{prefix}/acceptance_length"] = float(length)
    if m.get("acceptance_rate") is not None:
        out[f"{prefix}/acceptance_rate"] = float(m.pop("acceptance_rate"))
    for i, rate in enumerate(rates or []):
        out[f"{prefix}/per_position/{i}"] = float(rate)
    for key, value in m.items():
        if isinstance(value, bool):
            out[f"{prefix}/{key}"] = float(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[f"{prefix}/{key}"] = value
    return out


def resolve_wandb_mode(mode: str | None = None) -> str:
    """The explicit mode, else ``$WANDB_MODE``, else online iff an API key is configured."""
    if mode is None:
        mode = os.environ.get("WANDB_MODE") or ("online" if has_wandb_api_key() else "offline")
    mode = str(mode)  # a config enum member -> its value
    mode = {"dryrun": "offline", "run": "online", "disable": "disabled"}.get(mode, mode)
    if mode not in ("online", "offline", "disabled", "shared"):
        raise config_error("mode", mode, "online, offline, disabled or None (from WANDB_MODE "
                                         "and the API key)", "WandbLogger")
    return mode


def has_wandb_api_key() -> bool:
    """``WANDB_API_KEY`` is set, or the netrc file has a login for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC") or str(Path.home() / ".netrc")
    try:
        return bool(host and netrc.netrc(path).authenticators(host))
    except (OSError, netrc.NetrcParseError):
        return False


def _settings(wandb, init_timeout: float):
    return wandb.Settings(silent=True, console="off", init_timeout=init_timeout)


# ---- reading an offline run back ------------------------------------------------------------

_BLOCK, _HEADER = 32768, 7  # the .wandb file is a LevelDB-style log of protobuf records


def _raw_records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a .wandb run file")
    pos, parts = _HEADER, b""
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER:  # block trailer padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0:  # zero fill: end of the written data
            break
        if kind == 1:  # full
            yield chunk
        elif kind == 2:  # first
            parts = chunk
        elif kind == 3:  # middle
            parts += chunk
        elif kind == 4:  # last
            yield parts + chunk
            parts = b""


def read_wandb_file(run_dir: str | os.PathLike, timeout: float = 10.0) -> dict[str, Any]:
    """History rows and summary of a local run (``.../wandb/offline-run-*`` or the ``.wandb``
    file itself): ``{"history": [{key: value}, ...], "summary": {key: value}, "complete": bool}``.

    W&B's service writes the file asynchronously, also after ``run.finish()`` returns, so this
    waits up to ``timeout`` seconds for the run's final ``exit`` record (``complete``). Nested
    keys are joined with "/". Uses W&B's protobuf definitions; no network.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    path = Path(run_dir)
    deadline = time.monotonic() + timeout
    while True:
        files = sorted(path.glob("*.wandb")) if path.is_dir() else [path]
        if files and files[0].exists():
            records = []
            for raw in _raw_records(files[0]):
                record = pb.Record()
                record.ParseFromString(raw)
                records.append(record)
            complete = any(r.WhichOneof("record_type") == "exit" for r in records)
            if complete or time.monotonic() > deadline:
                break
        elif time.monotonic() > deadline:
            raise FileNotFoundError(f"no .wandb file in {path}")
        time.sleep(0.05)

    def items(entries) -> dict[str, Any]:
        return {(e.key or "/".join(e.nested_key)): json.loads(e.value_json) for e in entries}

    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(items(record.history.item))
        elif kind == "summary":
            summary.update(items(record.summary.update))
    return {"history": history, "summary": summary, "complete": complete}
