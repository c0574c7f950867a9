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
