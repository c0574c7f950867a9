"""The one name -> class registry behind proposers (engine) and objectives (training)."""

import pytest

from infer.proposers.base import PROPOSERS, Proposer
from infer.registry import Registry
from train.objectives.base import OBJECTIVES, Objective


def test_register_get_and_names():
    reg = Registry("infer.proposers", "method", "somewhere")

    @reg.register("one")
    class One:
        pass

    assert reg.get("one") is One and One.name == "one"
    with pytest.raises(ValueError, match=r"somewhere: invalid value for 'method': 'two'; "
                                         r"expected one of one"):
        reg.get("two")


@pytest.mark.parametrize("registry, base, name", [(PROPOSERS, Proposer, "ngram"),
                                                  (OBJECTIVES, Objective, "eagle3")])
def test_duplicate_names_are_an_error(registry, base, name):
    registry.load_all()
    before = registry.get(name)

    class Again(base):
        pass

    with pytest.raises(ValueError, match=rf"'{name}' is registered twice"):
        registry.register(name)(Again)
    assert registry.get(name) is before  # the first registration stands


def test_every_builtin_is_registered():
    assert {"ngram", "suffix", "draft_model", "eagle", "eagle3",
            "mlp_speculator"} <= set(PROPOSERS.names())
    assert set(OBJECTIVES.names()) == {"eagle", "eagle3", "mlp_speculator", "pard"}
    with pytest.raises(ValueError, match="serves: .*eagle3"):
        PROPOSERS.get("no_such_method")
    with pytest.raises(ValueError, match=r"'drafter.method': 'x'.*eagle3, mlp_speculator, pard"):
        OBJECTIVES.get("x")
