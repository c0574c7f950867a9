"""Run by test_interrupted_runs.py in a subprocess, so that real signals can reach it.

Each mode runs inside ``infer.foundation.entry.user_errors("train.py")``, the entry point's
handling of
``Interrupted`` (one line on stderr, exit 128 + signal), and writes nothing the test does not
check. The command line is the same for a run and its rerun, as a user would type it again; the
environment only says when to let the test send a signal:

- ``train OUT``: ``TinyLM`` (test_trainer.py) trained by ``train.trainer.train`` and exported
  to ``OUT/t/final``. ``PAUSE_AT=N``: after step N write ``OUT/paused-<rank>`` (holding the
  pid) and wait for ``OUT/go`` (a signal sent in between lands at a known step); ``STEP_SLEEP=s``: sleep after every step (a
  SIGKILL at a random moment lands inside the run).
- ``features DATASET TARGET CACHE``: ``build_feature_cache`` (rows per shard 8, batch 4) under
  ``raise_on_signals``, each target forward slowed by ``SLOW`` seconds.
- ``regenerate DATASET TARGET OUT``: ``regenerate`` (chunks of 2 rows) under ``raise_on_signals``,
  each generate call slowed by ``SLOW`` seconds.
"""

import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

from infer.foundation.entry import user_errors
from infer.foundation.signals import raise_on_signals

TRAIN_KW = dict(max_steps=8, micro_batch_size=2, lr=0.05)
FEATURE_KW = dict(dtype="float32", rows_per_shard=8, batch_size=4, progress=False)
REGEN_KW = dict(device="cpu", progress=False, chunk_size=2)


def feature_spec():
    from train.objectives.base import FeatureSpec

    return FeatureSpec(aux_layer_ids=(1, 2, 4), hidden=True)


def regen_config():
    from train.config import RegenerateConfig

    return RegenerateConfig(enabled=True, temperature=0.8, top_p=0.9, max_tokens=6, batch_size=2)


def trainer_tests():
    spec = importlib.util.spec_from_file_location("trainer_tests",
                                                  Path(__file__).with_name("test_trainer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step_hook(out: Path):
    pause_at, sleep = int(os.environ.get("PAUSE_AT", "0")), float(os.environ.get("STEP_SLEEP", 0))
    rank = os.environ.get("RANK", "0")  # under accelerate launch: each rank pauses

    def hook(step: int) -> None:
        if step == pause_at:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"paused-{rank}").write_text(str(os.getpid()))
            deadline = time.monotonic() + 120
            while not (out / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.005)
        time.sleep(sleep)
    return hook


def train(out: Path) -> None:
    tt = trainer_tests()
    save_every = int(os.environ.get("SAVE_EVERY", "0"))
    cfg = tt.make_cfg(out, save_every=save_every, **TRAIN_KW)
    with raise_on_signals("as train/pipeline.py does around the trainer"):
        tt.run(cfg, tt.synthetic_rows(16), final=True, _on_step=step_hook(out))


def slowed(fn, seconds: float):
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)
    return slow


def features(dataset: str, target: str, cache: str) -> None:
    import datasets

    from train import features as F

    F.capture = slowed(F.capture, float(os.environ.get("SLOW", "0")))
    frozen = F.FrozenTarget(target, "float32", "cpu")
    with raise_on_signals("finished shards are kept"):
        F.build_feature_cache(frozen, datasets.load_from_disk(dataset), feature_spec(), cache,
                              **FEATURE_KW)


def regenerate(dataset: str, target: str, out: str) -> None:
    import datasets

    from infer import LLM
    from train.regenerate import regenerate

    LLM.generate = slowed(LLM.generate, float(os.environ.get("SLOW", "0")))
    with raise_on_signals("finished chunks are kept"):
        regenerate(datasets.load_from_disk(dataset), target, regen_config(), out, **REGEN_KW)


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, *args = sys.argv[1:]
    with user_errors("train.py"):
        if mode == "train":
            train(Path(args[0]))
        else:
            {"features": features, "regenerate": regenerate}[mode](*args)
