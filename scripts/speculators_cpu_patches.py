"""Run vllm-project/speculators' trainer (0.9.x) on a CPU-only torch, in speculators' own env.

    /work/spec-env/bin/python scripts/speculators_cpu_patches.py train [speculators train flags]
    /work/spec-env/bin/python scripts/speculators_cpu_patches.py probe DATA RATIO SEED LEN [LEN ..]

Used by ``compare_speculators.py``; imports nothing from draftsmith (it runs in the other
environment). speculators' trainer assumes an accelerator in a few places; each patch below
changes only where a tensor lives or a device-only call, never what is computed:

1. ``Trainer`` moves the model and every batch to ``get_local_rank()`` (``0`` = ``cuda:0``):
   it gets ``"cpu"`` instead.
2. ``Trainer.device_type`` falls back to ``"cuda"`` without an accelerator, and
   ``torch.autocast("cuda")`` on a CPU build disables itself with a warning: it gets ``"cpu"``
   (with ``--hidden-states-dtype float32`` CPU autocast is off, so the step runs in float32,
   as draftsmith's does on CPU; with ``bfloat16`` it would be real CPU autocast).
3. The step timer calls ``torch.accelerator.synchronize()`` on logged steps, which raises when
   there is no accelerator: a no-op then.
4. The DataLoader asks for ``pin_memory=True`` (meaningless without an accelerator; warns on every
   loader): off.

The rest is speculators' CLI as is: ``--draft-attn-impl sdpa`` (flex attention is compiled for
GPUs) and ``--loss-implementation eager`` (the fused losses are Triton kernels) are its own
options. ``probe`` prints, for each packed length, the mean tokens per batch and batches per
epoch of speculators' own multipack sampler over the training split (to match draftsmith's
tokens per step).
"""

from __future__ import annotations

import json
import sys


def apply_cpu_patches() -> None:
    """The four patches of the module doc; once per process, before the trainer is built."""
    import torch
    from speculators.train import dataloader, trainer

    trainer.get_local_rank = lambda: "cpu"  # 1

    init = trainer.Trainer.__init__

    def cpu_init(self, *args, **kwargs):  # 2
        init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = cpu_init

    sync = torch.accelerator.synchronize
    torch.accelerator.synchronize = (  # 3
        lambda *a, **k: sync(*a, **k) if torch.accelerator.is_available() else None)

    loader = dataloader.DataLoader

    def no_pin(*args, **kwargs):  # 4
        kwargs["pin_memory"] = False
        return loader(*args, **kwargs)

    dataloader.DataLoader = no_pin


def train(argv: list[str]) -> None:
    """``speculators train ARGV`` with the patches applied (its own config resolution)."""
    apply_cpu_patches()
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    main(TrainConfig.resolve(argv))


def probe(data_path: str, ratio: float, seed: int, lengths: list[int]) -> None:
    """Mean tokens per batch and batches per epoch of speculators' sampler over the training
    split (``--train-data-ratio`` = ``ratio``), per packed length (epoch 0's shuffle)."""
    from speculators.train.data import ArrowDataset
    from speculators.train.distributed_batch_sampler import (
        MultipackDistributedBatchSamplerV2,
    )

    ds = ArrowDataset(max_len=max(lengths), datapath=data_path, train_ratio=ratio,
                      split="train", on_missing="raise")
    out = {}
    for length in lengths:
        sampler = MultipackDistributedBatchSamplerV2(
            batch_max_length=length, lengths=ds.approx_lengths, num_replicas=1, rank=0,
            seed=seed)
        sampler.set_epoch(0)
        batches = list(sampler)
        tokens = sum(min(length, sum(ds.approx_lengths[i] for i in b)) for b in batches)
        out[length] = {"batches": len(batches), "tokens_per_batch": tokens / len(batches)}
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("train", "probe"):
        raise SystemExit(__doc__)
    if sys.argv[1] == "train":
        train(sys.argv[2:])
    else:
        probe(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), [int(x) for x in sys.argv[5:]])
