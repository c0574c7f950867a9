"""The training loop: accelerate (one CPU, DDP, FSDP, DeepSpeed ZeRO) around an ``Objective``.

``train`` is the whole loop: rows -> seeded, resumable DataLoader -> batch on the device ->
``add_features`` (online target features) -> ``model(batch)`` through the prepared module
(DDP / FSDP / DeepSpeed see the call, so gradients synchronise) -> accumulate -> clip -> AdamW
-> warmup + cosine / linear / constant schedule, with tqdm on rank 0, logging every ``log_every``
steps, NaN/inf detection, atomic checkpoints and exact resume (train/checkpoint.py).

Step accounting: ``step`` counts optimizer steps. An epoch is ``ceil(batches per rank /
grad_accum)`` steps (accelerate syncs at the end of the dataloader, so an epoch's last window may
be short). Host syncs: one per optimizer step (a four-number all-reduce of loss, tokens and grad
norm, read back once), which NaN detection needs anyway; metrics stay on the device between logs.

Launch: ``python train.py`` (one process) or ``accelerate launch --config_file
conf/accelerate/<ddp_8gpu|fsdp_8gpu|deepspeed_zero2_8gpu|cpu_2proc>.yaml train.py ...``.
Batch geometry, clipping and precision always come from ``trainer`` (DeepSpeed's "auto" values
are filled from it), so one recipe runs unchanged on a laptop and on 8 GPUs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from infer.tracking import Logger
from infer.validation import check_float, check_int, config_error
from train import checkpoint as ckpt
from train.data import collate

TOKEN_FIELDS = ("input_ids", "loss_mask", "position_ids", "doc_ids")
SCHEDULES = ("cosine", "linear", "constant")
PRECISIONS = ("auto", "no", "bf16", "fp16")
ACC_KEYS = ("full_acc_0", "acc_0", "acc")  # shown in the progress bar, first found
WHERE = "train config"


@dataclass
class TrainResult:
    step: int  # optimizer steps of this stage (resumed ones included)
    tokens: int  # input tokens processed by all ranks in this stage
    tokens_per_s: float  # throughput of this session, all ranks
    metrics: dict[str, float] = field(default_factory=dict)  # last logged values, no prefix
    final_dir: Path | None = None


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


# ---- learning-rate schedule -------------------------------------------------------------------

def num_warmup_steps(tcfg, total: int) -> int:
    """``warmup_steps`` when set, else ``round(warmup_ratio * total)``."""
    return tcfg.warmup_steps if tcfg.warmup_steps > 0 else round(tcfg.warmup_ratio * total)


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of ``trainer.lr`` for optimizer step ``step`` (0-based) of ``total``.

    Warmup: steps ``0 .. warmup - 1`` rise linearly, ``(step + 1) / (warmup + 1)`` (no step is
    wasted at lr 0), to the peak at step ``warmup``. Then ``schedule`` decays from 1 at step
    ``warmup`` towards ``min_lr_ratio``, reached at ``total`` (just after the last step, which
    therefore still learns): cosine or linear in ``(step - warmup) / (total - warmup)``; constant
    stays at 1.
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return min_lr_ratio + (1 - min_lr_ratio) * shape


def _plan(tcfg, batches_per_epoch: int) -> dict[str, int]:
    per_epoch = math.ceil(batches_per_epoch / tcfg.grad_accum)
    total = tcfg.max_steps or max(1, math.ceil(tcfg.epochs * per_epoch))
    return {"total": total, "per_epoch": per_epoch, "warmup": num_warmup_steps(tcfg, total)}


def _set_hyperparameters(optimizer, scheduler, tcfg, plan, step: int) -> None:
    """This run's lr / betas / weight decay on a (possibly restored) optimizer: a checkpoint
    carries the old values, and resuming with new ones (lower lr after a divergence) is allowed."""
    scheduler.base_lrs = [tcfg.lr] * len(scheduler.base_lrs)
    factor = lr_factor(step, plan["total"], plan["warmup"], tcfg.schedule, tcfg.min_lr_ratio)
    for group in optimizer.param_groups:
        group.update(initial_lr=tcfg.lr, lr=tcfg.lr * factor, betas=tuple(tcfg.betas),
                     weight_decay=tcfg.weight_decay if group.get("decay", True) else 0.0)


# ---- setup -----------------------------------------------------------------------------------

def use_cpu(tcfg) -> bool:
    """``trainer.device`` cpu, or auto without a visible GPU. Pass the same value to any
    ``PartialState(cpu=...)`` made before ``train``: launched workers (torchrun) without a GPU
    only form a process group (gloo) when accelerate is told to use the CPU."""
    return tcfg.device == "cpu" or (tcfg.device == "auto" and not torch.cuda.is_available())


def resolve_mixed_precision(tcfg) -> str:
    """``auto``: bf16 on a GPU that has it, else none (fp32 on CPU)."""
    if tcfg.mixed_precision != "auto":
        return tcfg.mixed_precision
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


def make_optimizer(objective: torch.nn.Module, tcfg) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; norms and biases (1-D) get no weight decay."""
    params = [p for p in objective.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{type(objective).__name__} has no trainable parameters "
                         "(its drafter must hold parameters with requires_grad=True)")
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": tcfg.weight_decay,
               "decay": True},  # the flag survives DeepSpeed's flattening of "params"
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "decay": False}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=tcfg.lr,
                             betas=tuple(tcfg.betas))


def _fill_deepspeed(accelerator, tcfg) -> None:
    """DeepSpeed "auto" clipping <- ``trainer.max_grad_norm`` (micro batch and accumulation are
    filled by ``accelerator.prepare``; accelerate would otherwise put 1.0 here)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.get_value("gradient_clipping") in (None, "auto"):
        plugin.deepspeed_config["gradient_clipping"] = float(tcfg.max_grad_norm)


def validate(tcfg, num_rows: int) -> None:
    """Every trainer key the loop relies on, checked before any process group work."""
    for key in ("micro_batch_size", "grad_accum", "log_every"):
        check_int(f"trainer.{key}", getattr(tcfg, key), WHERE, minimum=1)
    for key in ("save_every", "warmup_steps", "num_workers", "keep_last"):
        check_int(f"trainer.{key}", getattr(tcfg, key), WHERE, minimum=0)
    check_int("trainer.max_steps", tcfg.max_steps, WHERE, minimum=1, optional=True)
    check_float("trainer.lr", tcfg.lr, WHERE, low=0.0, low_open=True)
    check_float("trainer.epochs", tcfg.epochs, WHERE, low=0.0, low_open=True)
    check_float("trainer.warmup_ratio", tcfg.warmup_ratio, WHERE, low=0.0, high=1.0)
    check_float("trainer.min_lr_ratio", tcfg.min_lr_ratio, WHERE, low=0.0, high=1.0)
    check_float("trainer.max_grad_norm", tcfg.max_grad_norm, WHERE, low=0.0)
    check_float("trainer.weight_decay", tcfg.weight_decay, WHERE, low=0.0)
    if len(tcfg.betas) != 2 or not all(0 <= b < 1 for b in tcfg.betas):
        raise config_error("trainer.betas", list(tcfg.betas), "two numbers in [0, 1)", WHERE)
    if tcfg.schedule not in SCHEDULES:
        raise config_error("trainer.schedule", tcfg.schedule, " | ".join(SCHEDULES), WHERE)
    if tcfg.mixed_precision not in PRECISIONS:
        raise config_error("trainer.mixed_precision", tcfg.mixed_precision, " | ".join(PRECISIONS),
                           WHERE)
    if tcfg.device not in ("auto", "cpu", "cuda"):
        raise config_error("trainer.device", tcfg.device, "auto | cpu | cuda", WHERE)
    if tcfg.device == "cuda" and not torch.cuda.is_available():
        raise config_error("trainer.device", "cuda", "auto or cpu (no CUDA device is visible)",
                           WHERE)
    if num_rows == 0:
        raise ValueError("train: the training dataset is empty (0 rows); check data.source and "
                         "data.max_length (rows without loss tokens are dropped)")


# ---- per-step bookkeeping --------------------------------------------------------------------

class _Meter:
    """Running sums between host syncs: device tensors inside the micro-step, floats after the
    one sync of each optimizer step, averaged over the log window (all micro-batches, all ranks)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._new_step()
        self._new_window()

    def _scalar(self, value: float) -> Tensor:
        return torch.full((), float(value), device=self.device)  # a fill kernel: no copy, no sync

    def _new_step(self) -> None:
        self.loss = self._scalar(0)  # [] sum of micro-batch losses
        self.micro, self.tokens = 0, 0

    def _new_window(self) -> None:
        self.sums: dict[str, Tensor] = {}  # metric -> [] sum over micro-batches
        self.window_micro, self.steps, self.window_tokens = 0, 0, 0
        self.loss_sum, self.gn_sum = 0.0, 0.0  # sums of per-step values (host floats)
        self.t0 = time.perf_counter()

    def add(self, out, batch: dict[str, Tensor]) -> None:
        self.loss += out.loss.detach().float()
        self.micro += 1
        self.tokens += batch["input_ids"].numel()
        self.window_micro += 1
        for key, value in out.metrics.items():
            self.sums[key] = self.sums.get(key, 0) + value.detach().float()

    def end_step(self, accelerator, grad_norm) -> tuple[float, int, float]:
        """The step's (loss, tokens, grad norm) over all ranks: the one host sync per step."""
        if isinstance(grad_norm, Tensor):
            gn = grad_norm.detach().float().reshape(()).to(self.device)
        else:  # DeepSpeed reports a float (None before its first step)
            gn = self._scalar(0.0 if grad_norm is None else grad_norm)
        stats = torch.stack([self.loss, self._scalar(self.micro), self._scalar(self.tokens),
                             gn])  # [4]
        loss_sum, micro, tokens, gn_sum = accelerator.reduce(stats, "sum").tolist()
        self._new_step()
        loss, gn = loss_sum / micro, gn_sum / accelerator.num_processes
        self.steps += 1
        self.loss_sum, self.gn_sum, self.window_tokens = (
            self.loss_sum + loss, self.gn_sum + gn, self.window_tokens + int(tokens))
        return loss, int(tokens), gn

    def log_values(self, accelerator) -> dict[str, float]:
        """Window averages (rank mean of metrics); resets the window."""
        keys = sorted(self.sums)
        out: dict[str, float] = {}
        if keys:
            vec = torch.stack([self.sums[k] for k in keys]) / self.window_micro  # [K]
            out = dict(zip(keys, accelerator.reduce(vec, "mean").tolist()))
        seconds = max(time.perf_counter() - self.t0, 1e-9)
        out.update(loss=self.loss_sum / self.steps, grad_norm=self.gn_sum / self.steps,
                   tokens_per_s=self.window_tokens / seconds)
        self._new_window()
        return out


@dataclass
class _Position:
    step: int = 0
    epoch: int = 0
    batches: int = 0  # micro-batches of this epoch consumed on each rank
    tokens: int = 0


# ---- the loop --------------------------------------------------------------------------------

def train(cfg, objective, rows: torch.utils.data.Dataset, add_features: Callable[[dict], dict],
          *, pad_id: int, run_dir: Path, final_dir: Path | None, logger: Logger,
          stage: str = "main", accelerator=None,
          _on_step: Callable[[int], None] | None = None) -> TrainResult:
    """Train ``objective`` on ``rows``; checkpoints under ``run_dir/checkpoints``; the drafter
    exported to ``final_dir`` (when given). ``rows[i]``: packed-row fields (lists or ``[T]``
    tensors) plus optional cached features (``[T, D]`` tensors). ``add_features(batch)`` runs on
    the device batch (online target features; identity for an offline cache). ``stage`` names
    the run's checkpoint folder and log prefix (``train/`` for "main"). ``_on_step(step)`` runs
    after each optimizer step (tests use it to simulate a crash)."""
    tcfg = cfg.trainer
    validate(tcfg, len(rows))
    acc = accelerator or make_accelerator(tcfg, cfg.seed)
    if acc.gradient_accumulation_steps != tcfg.grad_accum:
        raise config_error("trainer.grad_accum", tcfg.grad_accum,
                           f"the accelerator's value ({acc.gradient_accumulation_steps}; remove "
                           "gradient_accumulation_steps from the accelerate / DeepSpeed config)",
                           WHERE)
    _fill_deepspeed(acc, tcfg)
    world, main = acc.num_processes, acc.is_main_process
    root = ckpt.checkpoint_root(run_dir, stage)
    compat = ckpt.compat_config(cfg, stage, world)

    raw_opt = make_optimizer(objective, tcfg)
    generator = torch.Generator().manual_seed(cfg.seed)  # keeps DataLoader draws off global RNG
    loader = DataLoader(rows, batch_size=tcfg.micro_batch_size, shuffle=True,
                        collate_fn=Collate(pad_id), num_workers=tcfg.num_workers,
                        generator=generator, pin_memory=acc.device.type == "cuda")
    plan = _plan(tcfg, math.ceil(len(loader) / world))
    raw_sched = torch.optim.lr_scheduler.LambdaLR(raw_opt, lambda s: lr_factor(
        s, plan["total"], plan["warmup"], tcfg.schedule, tcfg.min_lr_ratio))
    model, optimizer, loader, scheduler = acc.prepare(objective, raw_opt, loader, raw_sched)
    plan.update(_plan(tcfg, len(loader)))  # the prepared (per-rank) length is authoritative
    clip_params = list(model.parameters())

    resume_from, pos, metrics = _start(acc, tcfg, root, compat, stage)
    _set_hyperparameters(raw_opt, raw_sched, tcfg, plan, pos.step)
    acc.wait_for_everyone()
    if main:
        note = f", resuming from {resume_from} (step {pos.step})" if resume_from else ""
        print(f"trainer[{stage}]: {acc.device} x {world} process(es) "
              f"({acc.distributed_type.value}), mixed precision {acc.mixed_precision}, "
              f"batch {tcfg.micro_batch_size} x {tcfg.grad_accum} accum x {world} = "
              f"{tcfg.micro_batch_size * tcfg.grad_accum * world} rows/step; {plan['total']} "
              f"steps ({plan['per_epoch']}/epoch over {len(rows)} rows){note}", flush=True)

    prefix = "train" if stage == "main" else stage
    max_norm = tcfg.max_grad_norm if tcfg.max_grad_norm > 0 else float("inf")
    check_grad = acc.mixed_precision != "fp16"  # fp16: the scaler skips inf steps by design
    meter, last_ckpt = _Meter(acc.device), resume_from
    pbar = tqdm(total=plan["total"], initial=pos.step, desc=f"train[{stage}]", unit="step",
                disable=not main, dynamic_ncols=True)
    t_start, session_tokens = time.perf_counter(), 0
    try:
        while pos.step < plan["total"]:
            loader.set_epoch(pos.epoch)
            epoch_loader = acc.skip_first_batches(loader, pos.batches) if pos.batches else loader
            batches = iter(epoch_loader)
            try:
                for batch in batches:
                    pos.batches += 1
                    lr = optimizer.param_groups[0]["lr"]  # this step's (DeepSpeed steps early)
                    batch = add_features(batch)
                    with acc.accumulate(model):
                        out = model(batch)
                        acc.backward(out.loss)
                        meter.add(out, batch)
                        synced = acc.sync_gradients
                        if synced:
                            grad_norm = acc.clip_grad_norm_(clip_params, max_norm)
                            loss, tokens, gn = meter.end_step(acc, grad_norm)
                            if not math.isfinite(loss) or (check_grad and not math.isfinite(gn)):
                                raise TrainingDiverged(
                                    f"training diverged at step {pos.step + 1} (stage {stage!r}):"
                                    f" loss={loss}, grad_norm={gn}. Nothing of this state was "
                                    "saved; the last checkpoint is "
                                    f"{last_ckpt or 'none (none was written yet)'}. Lower "
                                    "trainer.lr or raise trainer.warmup_steps (or check the "
                                    "data), then rerun: trainer.resume=auto continues from it.")
                            optimizer.step()
                            scheduler.step()
                            optimizer.zero_grad(set_to_none=True)
                    if not synced:
                        continue
                    pos.step += 1
                    pos.tokens += tokens
                    session_tokens += tokens
                    if pos.batches >= len(loader):  # the epoch is done: record the next one
                        pos.epoch, pos.batches = pos.epoch + 1, 0
                    if pos.step % tcfg.log_every == 0 or pos.step == plan["total"]:
                        metrics = meter.log_values(acc)
                        metrics.update(lr=lr, tokens=float(pos.tokens),
                                       epoch=pos.step / plan["per_epoch"])
                        data = {f"{prefix}/{k}": v for k, v in metrics.items()}
                        if stage == "main":
                            logger.log(data, step=pos.step)
                        else:  # stages restart at step 0; W&B steps must keep increasing
                            logger.log({**data, f"{prefix}/step": pos.step})
                    pbar.update(1)
                    pbar.set_postfix(_postfix(loss, lr, metrics), refresh=False)
                    if (tcfg.save_every and pos.step % tcfg.save_every == 0) \
                            or pos.step == plan["total"]:
                        last_ckpt = _save(acc, model, objective, root, pos, stage, compat,
                                          metrics, tcfg.keep_last)
                    if _on_step is not None:
                        _on_step(pos.step)
                    if pos.step >= plan["total"]:
                        break
            finally:
                if hasattr(batches, "close"):
                    batches.close()  # unregisters the dataloader from accelerate's state
        elapsed = max(time.perf_counter() - t_start, 1e-9)
        if final_dir is not None:
            state_dict = acc.get_state_dict(model)  # collective under ZeRO-3 / FSDP
            if main:
                ckpt.export_atomically(objective, state_dict, final_dir)
            acc.wait_for_everyone()
    finally:
        pbar.close()
        acc.free_memory()  # drop the wrapped model / engine references; a next stage re-prepares
    return TrainResult(pos.step, pos.tokens, session_tokens / elapsed,
                       {k: float(v) for k, v in metrics.items()},
                       Path(final_dir) if final_dir is not None else None)


def _start(acc, tcfg, root: Path, compat: dict, stage: str
           ) -> tuple[Path | None, _Position, dict[str, float]]:
    """Load the checkpoint ``trainer.resume`` names (model, optimizer, scheduler, RNG; the data
    position is returned), or clear this stage's old checkpoints for a fresh start."""
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
    acc.load_state(str(resume_from))
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
             "tokens": pos.tokens, "stage": stage, "fingerprint": ckpt.fingerprint(compat),
             "compat": compat, "metrics": metrics, "time": time.time()}
    path = ckpt.save_checkpoint(acc, model, objective, root, state)
    if acc.is_main_process:
        ckpt.prune(root, keep_last)
    acc.wait_for_everyone()
    return path
