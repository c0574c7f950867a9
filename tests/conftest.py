"""Suite-wide settings. Tests build tiny models in-process and never touch the network."""

import atexit
import os
import shutil
import tempfile

import torch

# Triton kernels run through the interpreter on CPU-only machines; it must be set before any
# module that defines a kernel is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tiny models: one thread avoids oversubscription on small CI machines and keeps timing stable.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Never read or build the user's cached tiny target: the suite must pass on a fresh machine.
os.environ["DRAFTSMITH_CACHE"] = tempfile.mkdtemp(prefix="draftsmith-test-cache-")
atexit.register(shutil.rmtree, os.environ["DRAFTSMITH_CACHE"], ignore_errors=True)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
