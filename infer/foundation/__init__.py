"""The foundation both halves of draftsmith stand on: the error types and the one config-error
format (errors, validation), safe file reading (files: safetensors, JSON, tokenizers; nothing
unpickled), atomic writes (atomic), name registries (registry), signal handling (signals), the
CPU thread policy (threads), experiment tracking (tracking) and the entry points' error handling
(entry). ``train/`` and ``infer/`` import these; none of them loads torch's engine or imports
the rest of ``infer/``, so a light import stays light (tests/test_structure.py)."""
