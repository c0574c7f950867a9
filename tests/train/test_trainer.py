"""The accelerate training loop with a tiny stand-in objective (the real ones live elsewhere).

``TinyLM`` predicts the next token from the token embedding plus a per-token feature
(``hidden``: cached in the rows, or added online by ``add_features``), with dropout so that exact
resume also has to restore the RNG. Synthetic rows follow ``next = (3 * tok + 1) % V``, so the
loss can fall within a few steps.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from infer.foundation.errors import FileFormatError, MissingFileError
from infer.foundation.tracking import Logger
from train.checkpoint import IncompatibleCheckpoint, export_atomically, list_checkpoints
from train.config import TrainConfig, TrainerConfig
from train.features import FeatureSource
from train.objectives.base import FeatureSpec, LossOutput, Objective
from train.trainer import Collate, TrainingDiverged, lr_factor, train

VOCAB, T, FEAT = 32, 16, 4
REPO = Path(__file__).resolve().parents[2]


class TinyLM(Objective):
    name = "tiny"

    def __init__(self, vocab: int = VOCAB, dim: int = 16, dropout: float = 0.1,
                 nan_after_calls: int | None = None, tie: bool = False):
        super().__init__(None, None, None, "")
        self.drafter = nn.ModuleDict({"embed": nn.Embedding(vocab, dim),
                                      "feat": nn.Linear(FEAT, dim),
                                      "head": nn.Linear(dim, vocab)})
        if tie:  # shared storage, as an MLP speculator with tie_weights
            self.drafter["head"].weight = self.drafter["embed"].weight
        self.dropout = nn.Dropout(dropout)
        self.nan_after_calls, self.calls = nan_after_calls, 0

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec()

    def forward(self, batch):
        self.calls += 1
        d = self.drafter
        x = d["embed"](batch["input_ids"]) + d["feat"](batch["hidden"].float())  # [B, T, D]
        logits = d["head"](self.dropout(torch.tanh(x)))[:, :-1]  # [B, T-1, V]
        target = batch["input_ids"][:, 1:]  # [B, T-1]
        mask = batch["loss_mask"][:, 1:] & (batch["doc_ids"][:, 1:] == batch["doc_ids"][:, :-1])
        n = mask.sum()
        ce = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")  # [B, T-1]
        loss = (ce * mask).sum() / n.clamp(min=1)
        if self.nan_after_calls is not None and self.calls > self.nan_after_calls:
            loss = loss * float("nan")
        acc = ((logits.argmax(-1) == target) & mask).sum() / n.clamp(min=1)
        return LossOutput(loss, {"acc_0": acc.detach()}, n)

    def export(self, path, state_dict=None):
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().clone() for k, v in self.drafter_state(state_dict).items()}
        save_file(weights, path / "model.safetensors")
        (path / "config.json").write_text(json.dumps({"method": "tiny", "vocab": VOCAB}))
        return path


def synthetic_rows(n: int, seed: int = 0) -> list[dict]:
    """Packed-row layout with a cached ``hidden [T, FEAT]`` feature per row."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = [int(torch.randint(VOCAB, (), generator=g))]
        for _ in range(T - 1):
            ids.append((3 * ids[-1] + 1) % VOCAB)
        rows.append({"input_ids": ids, "loss_mask": [0] + [1] * (T - 1),
                     "position_ids": list(range(T)), "doc_ids": [0] * T,
                     "hidden": torch.randn(T, FEAT, generator=g)})
    return rows


class RecordingLogger(Logger):
    def __init__(self):
        self.rows: list[tuple[dict, int | None]] = []

    def log(self, data, step=None):
        self.rows.append((dict(data), step))

    def log_table(self, *a, **k):
        pass

    def log_image(self, *a, **k):
        pass

    def finish(self):
        pass


def make_cfg(tmp_path, **trainer) -> TrainConfig:
    base = dict(lr=3e-2, max_steps=4, micro_batch_size=2, log_every=1, device="cpu",
                max_grad_norm=1.0, betas=[0.9, 0.95])
    return TrainConfig(name="t", output_dir=str(tmp_path), trainer=TrainerConfig(**{**base,
                                                                                   **trainer}))


def run(cfg, rows, tiny: dict | None = None, *, final=False, logger=None, add=lambda b: b,
        **kw):
    """``train`` on a freshly seeded ``TinyLM(**tiny)``, exported to ``cfg.final_dir`` with
    ``final`` (as the pipeline does); returns (objective, result)."""
    torch.manual_seed(0)
    objective = TinyLM(**(tiny or {}))
    result = train(cfg, objective, FeatureSource(rows, add), pad_id=0, run_dir=cfg.run_dir,
                   logger=logger or RecordingLogger(), gather_state=final, **kw)
    if result.state_dict is not None:  # the main process
        export_atomically(objective, result.state_dict, cfg.final_dir)
    return objective, result


def params(objective) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in objective.state_dict().items()}


# ---- pieces ----------------------------------------------------------------------------------

def test_collate_stacks_cached_features():
    rows = synthetic_rows(3)
    rows[2] = {**rows[2], "input_ids": rows[2]["input_ids"][:10],
               "loss_mask": rows[2]["loss_mask"][:10], "position_ids": list(range(10)),
               "doc_ids": [0] * 10, "hidden": rows[2]["hidden"][:10]}
    batch = Collate(pad_id=7)(rows)
    assert batch["input_ids"].shape == (3, T) and batch["loss_mask"].dtype == torch.bool
    assert batch["hidden"].shape == (3, T, FEAT)
    assert torch.equal(batch["hidden"][0], rows[0]["hidden"])
    assert torch.equal(batch["hidden"][2, 10:], torch.zeros(T - 10, FEAT))  # padded block
    assert batch["input_ids"][2, 10:].eq(7).all()


def test_lr_schedule_hand_checked(tmp_path):
    cos = [lr_factor(s, 6, 2, "cosine", 0.1) for s in range(6)]
    # warmup 1/3, 2/3; then p = (s - 2) / 4 = 0, 1/4, 1/2, 3/4 -> 0.1 + 0.9 * (1 + cos(pi p)) / 2
    c = math.cos(math.pi / 4)
    assert cos == pytest.approx([1 / 3, 2 / 3, 1.0, 0.1 + 0.45 * (1 + c), 0.55,
                                 0.1 + 0.45 * (1 - c)])
    lin = [lr_factor(s, 7, 2, "linear", 0.0) for s in range(7)]
    assert lin == pytest.approx([1 / 3, 2 / 3, 1.0, 0.8, 0.6, 0.4, 0.2])
    assert [lr_factor(s, 5, 1, "constant", 0.3) for s in range(5)] == [0.5] + [1.0] * 4
    # end to end: the lr logged at each step is the one that step used (warmup_ratio 0.25 of 8)
    logger = RecordingLogger()
    run(make_cfg(tmp_path, lr=0.1, max_steps=8, warmup_ratio=0.25, schedule="linear",
                 min_lr_ratio=0.2), synthetic_rows(16), logger=logger)
    logged = [row["train/lr"] for row, _ in logger.rows]
    expected = [0.1 * lr_factor(s, 8, 2, "linear", 0.2) for s in range(8)]
    # p = (s - 2) / 6 after two warmup steps: the last step (s = 7) is at 0.2 + 0.8 / 6
    assert logged == pytest.approx(expected)
    assert logged[:3] == pytest.approx([0.1 / 3, 0.2 / 3, 0.1])
    assert logged[-1] == pytest.approx(0.1 * (0.2 + 0.8 / 6))


# ---- the loop --------------------------------------------------------------------------------

def test_loss_falls_on_packed_rows_with_online_features(tmp_path, train_data):
    vocab = len(train_data.tokenizer)
    table = torch.randn(vocab, FEAT, generator=torch.Generator().manual_seed(1))  # frozen

    def add(batch):  # online features, applied to the batch on the device
        return {**batch, "hidden": table.to(batch["input_ids"].device)[batch["input_ids"]]}

    cfg = make_cfg(tmp_path, lr=2e-2, max_steps=24, micro_batch_size=4, log_every=4,
                   warmup_steps=2)
    logger = RecordingLogger()
    objective, result = run(cfg, train_data.dataset, dict(vocab=vocab, dim=32, dropout=0.0),
                            final=True, logger=logger, add=add)
    losses = [row["train/loss"] for row, _ in logger.rows]
    assert [step for _, step in logger.rows] == [4, 8, 12, 16, 20, 24]
    assert losses[-1] < 0.75 * losses[0], losses
    assert {"train/acc_0", "train/grad_norm", "train/tokens_per_s", "train/lr"} <= set(
        logger.rows[-1][0])
    rows = len(train_data.dataset)  # 8 steps per epoch (the last batch is short): 3 epochs
    assert result.step == 24 and result.tokens == 3 * rows * 128 and result.tokens_per_s > 0
    assert result.metrics["loss"] == pytest.approx(losses[-1])
    # the final export is the trained drafter, and so is the end-of-run checkpoint's copy
    final = load_file(cfg.final_dir / "model.safetensors")
    assert torch.equal(final["head.weight"], objective.drafter["head"].weight)
    (last,) = list_checkpoints(cfg.run_dir / "checkpoints")
    assert last.name == "step_00000024"
    assert torch.equal(load_file(last / "drafter" / "model.safetensors")["head.weight"],
                       final["head.weight"])
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["step"] == 24 and state["stage"] == "main" and state["tokens"] == result.tokens


def test_grad_accumulation_matches_larger_micro_batch(tmp_path):
    rows = synthetic_rows(8)
    common = dict(max_steps=2, max_grad_norm=0.0, lr=1e-2)
    big, _ = run(make_cfg(tmp_path / "a", micro_batch_size=4, grad_accum=1, **common), rows,
                 dict(dropout=0.0))
    acc, _ = run(make_cfg(tmp_path / "b", micro_batch_size=2, grad_accum=2, **common), rows,
                 dict(dropout=0.0))
    torch.manual_seed(0)
    init = params(TinyLM(dropout=0.0))
    for k, v in params(big).items():
        assert not torch.allclose(v, init[k])  # it trained
        torch.testing.assert_close(params(acc)[k], v, rtol=1e-5, atol=1e-6)


class Crash(Exception):
    pass


def crash_at(step):
    def hook(s):
        if s == step:
            raise Crash(s)
    return hook


def test_resume_is_exact_and_keep_last_prunes(tmp_path):
    # 12 rows / micro 2 = 6 batches = 3 steps per epoch with accum 2; 7 steps cross two epochs.
    rows = synthetic_rows(12)
    kw = dict(max_steps=7, grad_accum=2, save_every=2, keep_last=2)
    logger_a = RecordingLogger()
    full, res_a = run(make_cfg(tmp_path / "a", **kw), rows, logger=logger_a)
    root = tmp_path / "a" / "t" / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step_00000006", "step_00000007"]
    assert not list(root.glob(".tmp*"))
    state6 = json.loads((root / "step_00000006" / "trainer_state.json").read_text())
    assert (state6["epoch"], state6["batches_in_epoch"]) == (2, 0)

    cfg_b = make_cfg(tmp_path / "b", **kw)
    with pytest.raises(Crash):  # after step 3; the last checkpoint is step 2 (mid-epoch 0)
        run(cfg_b, rows, _on_step=crash_at(3))
    (ck,) = [p for p in list_checkpoints(cfg_b.run_dir / "checkpoints")
             if p.name == "step_00000002"]
    assert json.loads((ck / "trainer_state.json").read_text())["batches_in_epoch"] == 4
    torch.manual_seed(123)  # a differently initialised module: everything must come from disk
    logger_b, resumed = RecordingLogger(), TinyLM()
    res_b = train(cfg_b, resumed, FeatureSource(rows, lambda b: b), pad_id=0,
                  run_dir=cfg_b.run_dir, logger=logger_b)
    assert res_b.step == 7 and res_b.tokens == res_a.tokens
    assert [s for _, s in logger_b.rows] == [3, 4, 5, 6, 7]
    assert [r["train/loss"] for r, _ in logger_b.rows] == [r["train/loss"]
                                                          for r, _ in logger_a.rows[2:]]
    for k, v in params(full).items():
        assert torch.equal(params(resumed)[k], v), k

    # a checkpoint of different settings is refused, naming the path, the key and the way out
    cfg_c = make_cfg(tmp_path / "b", **kw)
    cfg_c.objective.ttt_steps = 5
    with pytest.raises(IncompatibleCheckpoint, match=r"(?s)step_00000007.*objective\.ttt_steps"
                                                     r".*trainer\.resume=never"):
        run(cfg_c, rows)
    with pytest.raises(FileNotFoundError, match="trainer.resume='/no/such'"):
        run(make_cfg(tmp_path / "b", resume="/no/such", **kw), rows)
    # ... and resume=never starts over, replacing the stage's checkpoints
    _, res_d = run(make_cfg(tmp_path / "b", resume="never", max_steps=1), rows)
    assert res_d.step == 1
    assert [p.name for p in list_checkpoints(cfg_b.run_dir / "checkpoints")] == ["step_00000001"]


def test_tied_weights_checkpoint_and_resume(tmp_path):
    rows = synthetic_rows(8)
    _, first = run(make_cfg(tmp_path, max_steps=2), rows, dict(tie=True))
    (ck,) = list_checkpoints(tmp_path / "t" / "checkpoints")
    assert (ck / "model.safetensors").is_file()  # accelerate stores the shared tensor once
    resumed, more = run(make_cfg(tmp_path, max_steps=3), rows, dict(tie=True))
    assert (first.step, more.step) == (2, 3)
    assert resumed.drafter["head"].weight is resumed.drafter["embed"].weight


class Payload:
    """A pickle that runs code when loaded: unpickling calls ``os.mkdir(marker)``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.mark.parametrize("name", ["optimizer.bin", "scheduler.bin", "random_states_0.pkl"])
def test_a_checkpoint_holding_a_code_pickle_is_refused_unrun(tmp_path, name):
    rows = synthetic_rows(8)
    run(make_cfg(tmp_path, max_steps=2), rows)
    (ck,) = list_checkpoints(tmp_path / "t" / "checkpoints")
    torch.save({"state": Payload(tmp_path / "ran")}, ck / name)
    torch.load(ck / name, weights_only=False)  # the payload is real: a plain load runs it
    assert (tmp_path / "ran").is_dir()
    (tmp_path / "ran").rmdir()
    with pytest.raises(FileFormatError, match=rf"(?s)checkpoint {ck}.*weights_only=True.*"
                                              r"trainer\.resume=never"):
        run(make_cfg(tmp_path, max_steps=3), rows)
    assert not (tmp_path / "ran").exists()
    (ck / "random_states_0.pkl").unlink(missing_ok=True)  # missing: no exact resume either
    with pytest.raises(MissingFileError, match=r"random_states_0\.pkl is missing"):
        run(make_cfg(tmp_path, max_steps=3), rows)


def test_nan_loss_stops_with_step_and_last_checkpoint(tmp_path):
    cfg = make_cfg(tmp_path, max_steps=6, grad_accum=2, save_every=2)
    # micro-batch calls 1-4 are steps 1-2; call 5 (step 3) returns NaN
    with pytest.raises(TrainingDiverged, match=r"step 3 .*step_00000002") as err:
        run(cfg, synthetic_rows(16), dict(nan_after_calls=4), final=True)
    assert "loss=nan" in str(err.value)
    root = cfg.run_dir / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step_00000002"]
    assert not list(root.glob(".tmp*")) and not cfg.final_dir.exists()


def test_invalid_trainer_value_is_named(tmp_path):
    with pytest.raises(ValueError, match="trainer.schedule.*cosine"):
        run(make_cfg(tmp_path, schedule="exp"), synthetic_rows(4))


# ---- two processes ---------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_cpu_processes_agree_and_resume(tmp_path):
    """``accelerate launch`` with conf/accelerate/cpu_2proc.yaml (gloo): both ranks end with the
    same parameters, the loss falls, and a crashed + resumed run equals an uninterrupted one."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "ACCELERATE_LOG_LEVEL": "error"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "conf/accelerate/cpu_2proc.yaml"), "--main_process_port",
           str(_free_port()), str(Path(__file__).with_name("trainer_two_procs.py")),
           str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 for r in ranks)
    assert ranks[0]["losses"][-1] < 0.7 * ranks[0]["losses"][0], ranks[0]["losses"]
    w = [load_file(tmp_path / f"rank{r}_{run}.safetensors") for r in (0, 1)
         for run in ("full", "resumed")]
    for k in w[0]:
        assert torch.equal(w[0][k], w[1][k]) and torch.equal(w[0][k], w[2][k]), k
        assert torch.equal(w[0][k], w[3][k]), k
    assert math.isclose(ranks[0]["final_loss"], ranks[1]["final_loss"])
    exported = load_file(tmp_path / "full" / "t" / "final" / "model.safetensors")
    assert torch.equal(exported["head.weight"], w[0]["drafter.head.weight"])


def test_a_stage_frees_its_optimizer_when_it_returns(tmp_path, monkeypatch):
    """No reference cycle keeps a finished stage's optimizer state (and prepared model) alive
    until the cyclic garbage collector happens to run: the next stage or the evaluation needs
    that memory."""
    import gc
    import weakref

    import train.trainer as trainer

    made, real = [], trainer.make_optimizer
    monkeypatch.setattr(trainer, "make_optimizer",
                        lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    gc.disable()
    try:
        run(make_cfg(tmp_path, max_steps=2), synthetic_rows(4))
        ref = weakref.ref(made.pop())
        assert ref() is None
    finally:
        gc.enable()


def test_leftovers_of_killed_checkpoint_writes_are_removed(tmp_path):
    from train.checkpoint import remove_temporaries

    root = tmp_path / "checkpoints"
    for name in (".tmp-step_00000004", ".step_00000002.old-12-ab", "step_00000002"):
        (root / name).mkdir(parents=True)
    remove_temporaries(root)
    assert [p.name for p in root.iterdir()] == ["step_00000002"]


def test_a_stage_can_start_from_the_previous_stages_optimizer_moments(tmp_path):
    """AdamW's per-parameter step count and moments continue into the next stage (IBM's MLP
    speculator stage 2), at the new stage's own learning rate."""
    rows = synthetic_rows(8)
    first_cfg = make_cfg(tmp_path / "a", max_steps=3)
    objective, first = run(first_cfg, rows, keep_optimizer_state=True)
    steps = {int(s["step"]) for s in first.optimizer_state["state"].values()}
    assert steps == {3}
    second_cfg = make_cfg(tmp_path / "b", max_steps=2, lr=1e-3, schedule="constant")
    carried = train(second_cfg, objective, FeatureSource(rows, lambda b: b), pad_id=0,
                    run_dir=second_cfg.run_dir, logger=RecordingLogger(), stage="stage2",
                    optimizer_state=first.optimizer_state, keep_optimizer_state=True)
    assert {int(s["step"]) for s in carried.optimizer_state["state"].values()} == {5}
    assert {g["lr"] for g in carried.optimizer_state["param_groups"]} == {1e-3}  # not 3e-2
    fresh = train(second_cfg, objective, FeatureSource(rows, lambda b: b), pad_id=0,
                  run_dir=tmp_path / "c", logger=RecordingLogger(), stage="stage2",
                  keep_optimizer_state=True)
    assert {int(s["step"]) for s in fresh.optimizer_state["state"].values()} == {2}
    assert run(make_cfg(tmp_path / "d", max_steps=1), rows)[1].optimizer_state is None


def test_deepspeed_and_fsdp_resume_only_their_own_checkpoints(tmp_path):
    """Their loaders unpickle without weights_only: a checkpoint from outside the run's own
    folder is refused under them, accepted under plain DDP / one process."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from infer.foundation.errors import ConfigError
    from train.checkpoint import check_unpickled_shards

    root = tmp_path / "run" / "checkpoints" / "main"
    own, foreign = root / "step_00000003", tmp_path / "elsewhere" / "step_00000003"
    for kind in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        acc = SimpleNamespace(distributed_type=kind)
        check_unpickled_shards(acc, own, root)
        with pytest.raises(ConfigError, match="copy it into"):
            check_unpickled_shards(acc, foreign, root)
    for kind in (DistributedType.NO, DistributedType.MULTI_CPU):
        check_unpickled_shards(SimpleNamespace(distributed_type=kind), foreign, root)


def test_muon_trains_and_resumes_exactly(tmp_path):
    """trainer.optimizer=muon through accelerate: checkpoints hold both optimizers' state, and
    a crashed run resumed ends where an uninterrupted one does."""
    rows = synthetic_rows(8)
    kw = dict(max_steps=4, save_every=2, optimizer="muon")
    full, res_a = run(make_cfg(tmp_path / "a", **kw), rows)
    cfg_b = make_cfg(tmp_path / "b", **kw)
    with pytest.raises(Crash):
        run(cfg_b, rows, _on_step=crash_at(3))
    resumed, res_b = run(cfg_b, rows)
    assert res_b.step == res_a.step == 4
    for k, v in params(full).items():
        assert torch.equal(params(resumed)[k], v), k
