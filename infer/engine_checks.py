"""The engine's argument and memory checks (vLLM's constructor rules), apart from the engine's
scheduling so that :mod:`infer.engine` stays about steps."""

from __future__ import annotations

import torch

from infer.foundation.validation import check_float, check_int, config_error

_WHERE = "LLM"


def kv_cache_bytes(cfg, rows: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of a :class:`KVCache` for ``rows`` sequences of ``max_len`` tokens (keys + values,
    the scratch column included)."""
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    return rows * (max_len + 1) * per_token


def check_memory_budget(used: int, cache: int, total: int, utilization: float,
                        max_num_seqs: int, max_model_len: int) -> None:
    """vLLM's ``gpu_memory_utilization``: what is allocated (``used`` bytes: weights, caches)
    plus the KV cache about to be (``cache``) must fit in that fraction of the device's
    ``total``; caches are sized by max_num_seqs x max_model_len, so a clear error beats an OOM
    later."""
    budget = utilization * total
    if used + cache > budget:
        gib = 2 ** 30
        raise config_error(
            "gpu_memory_utilization", utilization,
            f"room for what is allocated ({used / gib:.2f} GiB: weights, caches) and the KV "
            f"cache ({cache / gib:.2f} GiB for max_num_seqs={max_num_seqs} x "
            f"max_model_len={max_model_len}) within "
            f"{budget / gib:.2f} GiB of the device's {total / gib:.2f} GiB; lower max_model_len "
            "or max_num_seqs, or raise gpu_memory_utilization", _WHERE)


def check_engine_args(max_model_len, max_num_seqs, seed, util, tp) -> None:
    check_int("max_model_len", max_model_len, _WHERE, minimum=2, optional=True)
    check_int("max_num_seqs", max_num_seqs, _WHERE, minimum=1)
    check_int("seed", seed, _WHERE)
    check_float("gpu_memory_utilization", util, _WHERE, low=0.0, high=1.0, low_open=True)
    if tp != 1:
        raise config_error("tensor_parallel_size", tp,
                           "1 (draftsmith's engine runs on one device; serve with vLLM for "
                           "tensor parallelism)", _WHERE)


def check_loaded(dtype, device, max_model_len, tokenizer) -> None:
    """A loaded Target fixed these; a different value here would be silently ignored."""
    given = {"dtype": (dtype, "auto"), "device": (device, "auto"),
             "max_model_len": (max_model_len, None), "tokenizer": (tokenizer, None)}
    for key, (value, default) in given.items():
        if value != default:
            raise config_error(key, value, f"{default!r} when a loaded Target is passed (set it "
                               "in Target.load)", _WHERE)
