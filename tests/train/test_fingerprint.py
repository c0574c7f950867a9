"""The one stale-state check behind the feature cache, regenerated answers and checkpoints."""

import pytest

from train.fingerprint import check, differences, digest


def test_digest_ignores_key_order():
    assert digest({"a": 1, "b": [1, 2]}) == digest({"b": [1, 2], "a": 1})
    assert digest({"a": 1}) != digest({"a": 2})


def test_differences():
    saved, now = {"a": 1, "b": 2, "path": "/x"}, {"a": 1, "b": 3, "c": 0, "path": "/y"}
    assert differences(saved, now) == ["b", "c", "path"]
    assert differences(saved, now, ignore=["path"]) == ["b", "c"]
    assert differences(saved, now, keys=["a", "b"]) == ["b"]


def test_check_names_subject_keys_values_and_remedy():
    check({"a": 1}, {"a": 1}, subject="cache X", held="cache has", remedy="Delete X.")

    class Stale(ValueError):
        pass

    with pytest.raises(Stale) as err:
        check({"dtype": "float32", "n": 4}, {"dtype": "bfloat16", "n": 5}, subject="cache X",
              held="cache has", remedy="Delete X.", error=Stale)
    assert str(err.value) == ("cache X was built for a different 'dtype': cache has 'float32', "
                              "this run has 'bfloat16'; and a different 'n': cache has 4, this "
                              "run has 5. Delete X.")


def test_checkpoint_fingerprint_holds_what_changes_the_training_inputs():
    """A checkpoint resumes only with the regenerated answers and features it was trained on:
    ``regenerate.batch_size`` counts when answers are sampled (greedy ones are the same at any
    batch size), ``features.dtype`` when features come from the offline cache."""
    from train.checkpoint import compat_config
    from train.config import TrainConfig

    cfg = TrainConfig()
    greedy = compat_config(cfg, "main", 1)
    assert "regenerate.batch_size" not in greedy and "data.num_proc" not in greedy
    assert greedy["features.mode"] == "online" and "features.dtype" not in greedy
    cfg.regenerate.temperature, cfg.features.mode = 0.7, "offline"
    sampled = compat_config(cfg, "main", 1)
    assert sampled["regenerate.batch_size"] == 8 and sampled["features.dtype"] == "bfloat16"
    cfg.regenerate.batch_size, cfg.features.dtype = 4, "float32"
    assert differences(sampled, compat_config(cfg, "main", 1)) == [
        "features.dtype", "regenerate.batch_size"]
