"""The training loop: accelerate (one CPU, DDP, FSDP, DeepSpeed ZeRO) around an ``Objective``.

``train`` runs one stage the way torchtitan splits a loop: ``_StageLoop.micro_step`` (batch on
the device -> ``add_features`` (online target features) -> ``model(batch)`` through the prepared
module, so DDP / FSDP / DeepSpeed see the call and gradients synchronise -> backward),
``optimizer_step`` (clip, divergence check, AdamW, warmup + cosine / linear / constant schedule),
``log`` (every ``log_every`` steps; tqdm on rank 0) and ``checkpoint`` (atomic, exact resume:
train/checkpoint.py). Budget and schedule: train/schedule.py; metrics and the one host sync per
optimizer step: train/meter.py. SIGINT / SIGTERM: the loop stops at the next step boundary on
every rank, checkpointed (``train``'s doc); SIGKILL loses at most the steps since the last one.
Under ``torchrun`` / ``accelerate launch`` a Ctrl-C reaches each rank twice (the terminal's and
the launcher's forwarded copy: one request), and the launcher SIGKILLs ranks still running 30 s
later (its shutdown timeout): a longer save is cut, and the previous checkpoint stays.

Launch: ``python train.py`` (one process) or ``accelerate launch --config_file
conf/accelerate/<ddp_8gpu|fsdp_8gpu|deepspeed_zero2_8gpu|cpu_2proc>.yaml train.py ...``.
Batch geometry, clipping and precision always come from ``trainer`` (DeepSpeed's "auto" values
are filled from it), so one recipe runs unchanged on a laptop and on 8 GPUs.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import Tensor
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from infer.foundation.errors import Interrupted
from infer.foundation.signals import StopRequests
from infer.foundation.threads import GOVERNOR
from infer.foundation.tracking import Logger
from infer.foundation.validation import config_error
from train import checkpoint as ckpt
from train.config import validate_section
from train.optim import make_optimizer
from train.data import collate
from train.features import FeatureSource
from train.fingerprint import digest
from train.meter import Meter
from train.schedule import Plan, lr_factor, set_hyperparameters  # noqa: F401 (lr_factor: API)

if TYPE_CHECKING:
    from train.served_eval import ServedEval

TOKEN_FIELDS = ("input_ids", "loss_mask", "position_ids", "doc_ids")
ACC_KEYS = ("full_acc_0", "acc_0", "acc")  # shown in the progress bar, first found
WHERE = "train config"


@dataclass
class TrainResult:
    step: int  # optimizer steps of this stage (resumed ones included)
    tokens: int  # input tokens processed by all ranks in this stage
    tokens_per_s: float  # throughput of this session, all ranks
    metrics: dict[str, float] = field(default_factory=dict)  # last logged values, no prefix
    state_dict: dict[str, Tensor] | None = None  # gathered objective state (``gather_state``;
    # main process only): what ``checkpoint.export_atomically`` writes as the drafter
    optimizer_state: dict | None = None  # the optimizer's moments at the end, for a next stage
    # that carries them over (None under DeepSpeed / FSDP, whose optimizers are sharded)


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient norm. Raised before anything of the broken state is saved
    (and, except under DeepSpeed, whose engine steps inside ``backward``, before the optimizer
    applies the step), so the last checkpoint is a good one to continue from."""


class Collate:
    """Rows -> batch: ``train.data.collate`` for the token fields (``[B, T]``), ``torch.stack``
    for cached feature tensors (``aux`` / ``hidden`` ``[T, D]`` -> ``[B, T, D]``, zero-padded to
    the batch's T). A class, not a closure, so it pickles into DataLoader worker processes."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, Tensor]:
        batch = collate(rows, self.pad_id)
        T = batch["input_ids"].shape[1]
        for key, first in rows[0].items():
            if key in TOKEN_FIELDS or not isinstance(first, Tensor) or first.ndim == 0:
                continue
            feats = [r[key] for r in rows]  # each [T_i, ...]
            feats = [f if f.shape[0] == T else
                     torch.nn.functional.pad(f, (0, 0) * (f.ndim - 1) + (0, T - f.shape[0]))
                     for f in feats]
            batch[key] = torch.stack(feats)  # [B, T, ...]
        return batch


# ---- setup -----------------------------------------------------------------------------------

def use_cpu(tcfg) -> bool:
    """``trainer.device`` cpu, or auto without a visible GPU. Pass the same value to any
    ``PartialState(cpu=...)`` made before ``train``: launched workers (torchrun) without a GPU
    only form a process group (gloo) when accelerate is told to use the CPU."""
    return tcfg.device == "cpu" or (tcfg.device == "auto" and not torch.cuda.is_available())


def resolve_mixed_precision(tcfg) -> str:
    """``auto``: bf16 on a GPU that has it, else none (fp32 on CPU)."""
    if tcfg.mixed_precision != "auto":
        return str(tcfg.mixed_precision)
    if use_cpu(tcfg):
        return "no"
    return "bf16" if torch.cuda.is_bf16_supported() else "no"


def make_accelerator(tcfg, seed: int):
    """The run's Accelerator: seeded sampler (data order = f(seed, epoch), so resumable), the
    scheduler stepped by us once per optimizer step (not once per process)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    return Accelerator(cpu=use_cpu(tcfg), mixed_precision=resolve_mixed_precision(tcfg),
                       gradient_accumulation_steps=tcfg.grad_accum,
                       step_scheduler_with_optimizer=False,
                       dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True,
                                                                 data_seed=seed))


def _fill_deepspeed(accelerator, tcfg) -> None:
    """DeepSpeed "auto" clipping <- ``trainer.max_grad_norm`` (micro batch and accumulation are
    filled by ``accelerator.prepare``; accelerate would otherwise put 1.0 here)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.get_value("gradient_clipping") in (None, "auto"):
        plugin.deepspeed_config["gradient_clipping"] = float(tcfg.max_grad_norm)


def validate(tcfg, num_rows: int) -> None:
    """Every trainer key the loop relies on (the stage's copy: a stage may override some),
    checked before any process group work, by the config's own rules."""
    validate_section("trainer", tcfg)
    if num_rows == 0:
        raise ValueError("train: the training dataset is empty (0 rows); check data.source and "
                         "data.max_length (rows without loss tokens are dropped)")


@dataclass
class _Position:
    step: int = 0
    epoch: int = 0
    batches: int = 0  # micro-batches of this epoch consumed on each rank
    tokens: int = 0


# ---- the loop --------------------------------------------------------------------------------

def train(cfg, objective, source: FeatureSource, *, pad_id: int, run_dir: Path, logger: Logger,
          stage: str = "main", gather_state: bool = False, accelerator=None,
          optimizer_state: dict | None = None, keep_optimizer_state: bool = False,
          served: ServedEval | None = None,
          _on_step: Callable[[int], None] | None = None) -> TrainResult:
    """Train ``objective`` on ``source`` (``rows[i]``: packed-row fields, lists or ``[T]``
    tensors, plus optional cached ``[T, D]`` features; ``add_features(batch)`` runs on the
    device batch) for one stage; checkpoints under ``run_dir/checkpoints``. ``stage`` names the
    checkpoint folder and log prefix (``train/`` for "main"). ``gather_state``: return the full
    objective state dict (collective under ZeRO-3 / FSDP; main process only) for the export.
    ``optimizer_state``: an earlier stage's ``TrainResult.optimizer_state`` to start from (its
    moments; this stage's lr and schedule apply; a checkpoint of this stage wins on resume);
    ``keep_optimizer_state`` returns this stage's for a next one (else it is freed).
    ``served`` (``train/served_eval.py``) measures served acceptance on the main process every
    ``served.every_steps`` optimizer steps; its values are logged under ``served/``.
    ``_on_step(step)`` runs after each optimizer step (tests use it to simulate a crash).

    SIGINT / SIGTERM (main thread) ask the loop to stop. The request is voted on in the one sync
    of the next optimizer step (``Meter.end_step``: no extra collective), so every rank, signalled
    or not, stops after that same step: it is checkpointed, then
    ``infer.foundation.errors.Interrupted``
    names the checkpoint; a rerun resumes from it exactly. A repeated signal aborts without
    saving (``infer/foundation/signals.py``); one arriving after the last step goes to the
    caller's handler."""
    loop = _StageLoop(cfg, objective, source, pad_id, run_dir, logger, stage, accelerator,
                      optimizer_state, served)
    if loop.acc.device.type == "cpu":
        GOVERNOR.start(cfg.trainer.num_threads)
    start, session_tokens = time.perf_counter(), 0
    try:
        with loop.stop_requests() as loop.stops:
            while loop.pos.step < loop.plan.total:
                session_tokens += loop.epoch(_on_step)
        elapsed = max(time.perf_counter() - start, 1e-9)
        state = loop.gather() if gather_state else None
        keep = keep_optimizer_state and carries_optimizer(loop.acc)
        moments = loop.raw_opt.state_dict() if keep else None
    finally:
        loop.close()
    return TrainResult(loop.pos.step, loop.pos.tokens, session_tokens / elapsed,
                       {k: float(v) for k, v in loop.metrics.items()}, state, moments)


def carries_optimizer(acc) -> bool:
    """Whether the plain torch optimizer holds all of its state on this rank (not DeepSpeed's
    or FSDP's sharded one), so that a next stage can start from its moments."""
    from accelerate.utils import DistributedType

    return acc.distributed_type not in (DistributedType.DEEPSPEED, DistributedType.FSDP)


class _StageLoop:
    """One stage's prepared training state and its four parts (see the module doc)."""

    def __init__(self, cfg, objective, source: FeatureSource, pad_id: int, run_dir: Path,
                 logger: Logger, stage: str, accelerator, optimizer_state: dict | None,
                 served: ServedEval | None = None) -> None:
        self.tcfg, self.objective, self.logger, self.stage = cfg.trainer, objective, logger, stage
        self.served = served
        validate(self.tcfg, len(source.rows))
        self.acc = accelerator or make_accelerator(self.tcfg, cfg.seed)
        if self.acc.gradient_accumulation_steps != self.tcfg.grad_accum:
            raise config_error("trainer.grad_accum", self.tcfg.grad_accum,
                               f"the accelerator's value ({self.acc.gradient_accumulation_steps};"
                               " remove gradient_accumulation_steps from the accelerate / "
                               "DeepSpeed config)", WHERE)
        _fill_deepspeed(self.acc, self.tcfg)
        self.root = ckpt.checkpoint_root(run_dir, stage)
        self.compat = ckpt.compat_config(cfg, stage, self.acc.num_processes)
        self.add_features = source.add_features
        self._prepare(cfg.seed, source.rows, pad_id, optimizer_state)
        self.last_ckpt, self.pos, self.metrics = _start(self.acc, self.tcfg, self.root,
                                                        self.compat, stage)
        set_hyperparameters(self.raw_opt, self.raw_sched, self.tcfg, self.plan, self.pos.step)
        self.acc.wait_for_everyone()
        self._announce(len(source.rows))
        self.prefix = "train" if stage == "main" else stage
        self.max_norm = self.tcfg.max_grad_norm if self.tcfg.max_grad_norm > 0 else float("inf")
        self.check_grad = self.acc.mixed_precision != "fp16"  # fp16: the scaler skips inf steps
        self.meter, self.lr, self.step_stats = Meter(self.acc.device), 0.0, (0.0, 0, 0.0)
        self.stops, self.stop_signal = StopRequests(), 0  # replaced by train's installed one
        self.pbar = tqdm(total=self.plan.total, initial=self.pos.step, desc=f"train[{stage}]",
                         unit="step", disable=not self.acc.is_main_process, dynamic_ncols=True)

    def _prepare(self, seed: int, rows, pad_id: int, optimizer_state: dict | None) -> None:
        """Optimizer (from ``optimizer_state`` where given and the optimizer is not sharded),
        seeded DataLoader and schedule, through ``accelerator.prepare``."""
        tcfg, acc = self.tcfg, self.acc
        self.raw_opt = make_optimizer(self.objective, tcfg)
        if optimizer_state is not None and carries_optimizer(acc):
            self.raw_opt.load_state_dict(optimizer_state)  # lr / betas: set_hyperparameters
        generator = torch.Generator().manual_seed(seed)  # keeps DataLoader draws off global RNG
        loader = DataLoader(rows, batch_size=tcfg.micro_batch_size, shuffle=True,
                            collate_fn=Collate(pad_id), num_workers=tcfg.num_workers,
                            generator=generator, pin_memory=acc.device.type == "cuda")
        plan = [Plan.of(tcfg, math.ceil(len(loader) / acc.num_processes))]
        self.raw_sched = torch.optim.lr_scheduler.LambdaLR(  # reads the final plan (below); no
            self.raw_opt, lambda s: plan[0].lr_factor(s, tcfg))  # reference to self: no cycle
        self.model, self.optimizer, self.loader, self.scheduler = acc.prepare(
            self.objective, self.raw_opt, loader, self.raw_sched)
        plan[0] = self.plan = Plan.of(tcfg, len(self.loader))  # the prepared (per-rank) length
        self.clip_params = list(self.model.parameters())

    def _announce(self, num_rows: int) -> None:
        if not self.acc.is_main_process:
            return
        t, acc, plan = self.tcfg, self.acc, self.plan
        note = (f", resuming from {self.last_ckpt} (step {self.pos.step})" if self.last_ckpt
                else "")
        world = acc.num_processes
        print(f"trainer[{self.stage}]: {acc.device} x {world} process(es) "
              f"({acc.distributed_type.value}), mixed precision {acc.mixed_precision}, "
              f"batch {t.micro_batch_size} x {t.grad_accum} accum x {world} = "
              f"{t.micro_batch_size * t.grad_accum * world} rows/step; {plan.total} "
              f"steps ({plan.per_epoch}/epoch over {num_rows} rows){note}", flush=True)

    # ---- the four parts ----------------------------------------------------------------------

    def epoch(self, on_step: Callable[[int], None] | None) -> int:
        """The rest of the current epoch (or of the budget); returns the tokens it processed."""
        pos, tokens = self.pos, 0
        self.loader.set_epoch(pos.epoch)
        loader = (self.acc.skip_first_batches(self.loader, pos.batches) if pos.batches
                  else self.loader)
        batches = iter(loader)
        try:
            for batch in batches:
                if self.acc.device.type == "cpu":
                    GOVERNOR.tick()  # one torch thread per free core (infer/foundation/threads.py)
                if not self.micro_step(batch):
                    continue
                tokens += self.after_step(on_step)
                if pos.step >= self.plan.total:
                    break
        finally:
            if hasattr(batches, "close"):
                batches.close()  # unregisters the dataloader from accelerate's state
        return tokens

    def micro_step(self, batch: dict[str, Tensor]) -> bool:
        """Forward and backward of one micro-batch; True when it completed an optimizer step."""
        self.pos.batches += 1
        self.lr = self.optimizer.param_groups[0]["lr"]  # this step's (DeepSpeed steps early)
        batch = self.add_features(batch)
        with self.acc.accumulate(self.model):
            out = self.model(batch)
            self.acc.backward(out.loss)
            self.meter.add(out, batch)
            synced = self.acc.sync_gradients
            if synced:
                self.optimizer_step()
        return synced

    def optimizer_step(self) -> None:
        """Clip, check that loss and gradient norm are finite (before anything is applied or
        saved), then step the optimizer and the schedule."""
        grad_norm = self.acc.clip_grad_norm_(self.clip_params, self.max_norm)
        pending = self.stops.signum  # this rank's stop request, voted on in the step's sync
        loss, tokens, gn, (stop, term) = self.meter.end_step(
            self.acc, grad_norm, (float(pending != 0), float(pending == signal.SIGTERM)))
        self.stop_signal = signal.SIGTERM if term else signal.SIGINT if stop else 0
        if not math.isfinite(loss) or (self.check_grad and not math.isfinite(gn)):
            raise TrainingDiverged(
                f"training diverged at step {self.pos.step + 1} (stage {self.stage!r}): "
                f"loss={loss}, grad_norm={gn}. Nothing of this state was saved; the last "
                f"checkpoint is {self.last_ckpt or 'none (none was written yet)'}. Lower "
                "trainer.lr or raise trainer.warmup_steps (or check the data), then rerun: "
                "trainer.resume=auto continues from it.")
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_stats = (loss, tokens, gn)

    def after_step(self, on_step: Callable[[int], None] | None) -> int:
        """Bookkeeping of a completed optimizer step: position, log, checkpoint; its tokens."""
        pos, tcfg = self.pos, self.tcfg
        loss, tokens, _ = self.step_stats
        pos.step += 1
        pos.tokens += tokens
        if pos.batches >= len(self.loader):  # the epoch is done: record the next one
            pos.epoch, pos.batches = pos.epoch + 1, 0
        if pos.step % tcfg.log_every == 0 or pos.step == self.plan.total:
            self.log()
        if self.served is not None and pos.step % self.served.every_steps == 0:
            self.log_served()
        self.pbar.update(1)
        self.pbar.set_postfix(_postfix(loss, self.lr, self.metrics), refresh=False)
        if (tcfg.save_every and pos.step % tcfg.save_every == 0) or pos.step == self.plan.total:
            self.checkpoint()
        if self.stop_signal:
            self.stop_here()
        if on_step is not None:
            on_step(pos.step)
        return tokens

    def log(self) -> None:
        """Window averages of the metrics, lr, tokens and epoch, under this stage's prefix."""
        self.metrics = self.meter.log_values(self.acc)
        self.metrics.update(lr=self.lr, tokens=float(self.pos.tokens),
                            epoch=self.pos.step / self.plan.per_epoch)
        self._emit({f"{self.prefix}/{k}": v for k, v in self.metrics.items()})

    def log_served(self) -> None:
        """Served acceptance of the current weights (collective gather, main process runs the
        engine), logged and printed beside the training accuracies."""
        state = self.gather()
        if state is not None:
            values = self.served(state)
            self._emit({f"served/{k}": v for k, v in values.items()})
            rates = " ".join(f"{values[f'acceptance_rate_pos_{i}']:.2f}"
                             for i in range(len(values) - 1))
            est = self.metrics.get("acceptance_length_est")
            self.pbar.write(f"served[{self.stage} step {self.pos.step}]: acceptance length "
                            f"{values['acceptance_length']:.3f} (per position {rates})"
                            + (f"; training estimate {est:.3f}" if est is not None else ""))
        self.acc.wait_for_everyone()

    def _emit(self, data: dict[str, float]) -> None:
        if self.stage == "main":
            self.logger.log(data, step=self.pos.step)
        else:  # stages restart at step 0; W&B steps must keep increasing
            self.logger.log({**data, f"{self.prefix}/step": self.pos.step})

    def checkpoint(self) -> None:
        self.last_ckpt = _save(self.acc, self.model, self.objective, self.root, self.pos,
                               self.stage, self.compat, self.metrics, self.tcfg.keep_last)

    # ---- stopping on a signal ----------------------------------------------------------------

    def stop_requests(self) -> StopRequests:
        """The handlers ``train`` installs around the loop (announced on the main process)."""
        announce = (f"trainer[{self.stage}]: {{signal}} received: stopping after this optimizer "
                    "step and saving a checkpoint (send it again to abort without saving)"
                    if self.acc.is_main_process else None)
        return StopRequests(announce, abort=f"stopped without saving; the latest checkpoint in "
                            f"{self.root} is complete: rerun the same command to resume")

    def stop_here(self) -> None:
        """Every rank agreed (in this step's sync) that a signal asked to stop: checkpoint this
        step unless it was just saved, then leave with ``Interrupted`` (exit 128 + signal)."""
        if self.last_ckpt is None or self.last_ckpt.name != ckpt.step_dir_name(self.pos.step):
            self.checkpoint()
        name = signal.Signals(self.stop_signal).name
        stage = "" if self.stage == "main" else f" of stage {self.stage!r}"
        raise Interrupted(f"interrupted by {name} at step {self.pos.step}{stage}; checkpoint "
                          f"saved to {self.last_ckpt}; rerun the same command to resume",
                          self.stop_signal)

    # ---- the end -----------------------------------------------------------------------------

    def gather(self) -> dict[str, Tensor] | None:
        """The full objective state dict on the main process (collective: every rank calls)."""
        state = self.acc.get_state_dict(self.model)  # gathered under ZeRO-3 / FSDP
        return state if self.acc.is_main_process else None

    def close(self) -> None:
        """Free what the stage held (a next stage prepares its own; under DeepSpeed the engine,
        on GPUs the optimizer state: gone before the next stage or the evaluation starts)."""
        self.pbar.close()
        self.acc.free_memory()
        self.model = self.optimizer = self.scheduler = self.loader = None
        self.raw_opt = self.raw_sched = self.clip_params = None


def _start(acc, tcfg, root: Path, compat: dict, stage: str
           ) -> tuple[Path | None, _Position, dict[str, float]]:
    """Load the checkpoint ``trainer.resume`` names (model, optimizer, scheduler, RNG; the data
    position is returned), or clear this stage's old checkpoints for a fresh start. Either way
    the main process first deletes the temporaries of killed checkpoint writes: no rank of this
    run writes into ``root`` before the loop starts (one run per run directory)."""
    if acc.is_main_process:
        ckpt.remove_temporaries(root)
    resume_from = ckpt.resolve_resume(tcfg.resume, root)
    if resume_from is None:
        if acc.is_main_process:
            removed = ckpt.remove_checkpoints(root)  # resume=never (auto: only temporaries)
            if removed:
                print(f"trainer.resume={tcfg.resume}: removed {len(removed)} earlier "
                      f"checkpoints of stage {stage!r} in {root}", flush=True)
        return None, _Position(), {}
    state = ckpt.read_state(resume_from)
    ckpt.check_compatible(resume_from, state, compat)
    ckpt.check_unpickled_shards(acc, resume_from, root)
    ckpt.load_state(acc, resume_from)  # weights only: a tampered pickle is refused
    pos = _Position(state["step"], state["epoch"], state["batches_in_epoch"], state["tokens"])
    return resume_from, pos, state.get("metrics", {})


def _postfix(loss: float, lr: float, metrics: dict[str, float]) -> dict[str, str]:
    post = {"loss": f"{loss:.4f}"}
    acc_key = next((k for k in ACC_KEYS if k in metrics), None)
    if acc_key:
        post["acc"] = f"{metrics[acc_key]:.3f}"
    if "tokens_per_s" in metrics:
        post["tok/s"] = f"{metrics['tokens_per_s']:.0f}"
    post["lr"] = f"{lr:.2e}"
    return post


def _save(acc, model, objective, root: Path, pos: _Position, stage: str, compat: dict,
          metrics: dict, keep_last: int) -> Path:
    state = {"step": pos.step, "epoch": pos.epoch, "batches_in_epoch": pos.batches,
             "tokens": pos.tokens, "stage": stage, "fingerprint": digest(compat),
             "compat": compat, "metrics": metrics, "time": time.time()}
    path = ckpt.save_checkpoint(acc, model, objective, root, state)
    if acc.is_main_process:
        ckpt.prune(root, keep_last)
    acc.wait_for_everyone()
    return path
