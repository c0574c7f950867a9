"""Resuming a checkpoint written before a setting existed: the missing key counts as the
setting's default (train/checkpoint.py check_compatible)."""

from pathlib import Path

import pytest

from train.checkpoint import IncompatibleCheckpoint, check_compatible, compat_config
from train.config import TrainConfig


def _old_state(cfg: TrainConfig, dropped: str) -> dict:
    """What an older draftsmith wrote: the same record without ``dropped``."""
    record = compat_config(cfg, "main", 1)
    del record[dropped]
    return {"fingerprint": "older", "compat": record}


def test_a_key_an_old_checkpoint_lacks_counts_as_its_default():
    cfg = TrainConfig()
    state = _old_state(cfg, "drafter.layer_from_target")
    check_compatible(Path("ck"), state, compat_config(cfg, "main", 1))  # default: resumes
    cfg.drafter.layer_from_target = True
    with pytest.raises(IncompatibleCheckpoint, match=r"'drafter\.layer_from_target': "
                                                     r"checkpoint has False, this run has True"):
        check_compatible(Path("ck"), state, compat_config(cfg, "main", 1))


def test_a_record_from_before_per_method_settings_resumes_and_still_guards_its_keys():
    """Checkpoints written when every method shared one drafter / objective section hold every
    method's keys: the ones this method does not have are not compared, its own still are."""
    cfg = TrainConfig()
    record = compat_config(cfg, "main", 1)
    old = {**record, "drafter.n_predict": 3, "objective.pard_k": 8, "objective.block_size": 16}
    state = {"fingerprint": "older", "compat": old}
    check_compatible(Path("ck"), state, compat_config(cfg, "main", 1))
    assert "drafter.n_predict" not in record and "objective.ttt_steps" in record
    cfg.objective.ttt_steps = 2
    with pytest.raises(IncompatibleCheckpoint, match=r"'objective\.ttt_steps'"):
        check_compatible(Path("ck"), state, compat_config(cfg, "main", 1))
