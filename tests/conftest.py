"""Suite-wide settings. Tests build tiny models in-process and never touch the network."""

import os

import torch

# Triton kernels run through the interpreter on CPU-only machines; it must be set before any
# module that defines a kernel is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tiny models: one thread avoids oversubscription on small CI machines and keeps timing stable.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
