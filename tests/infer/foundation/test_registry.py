"""The one name -> class registry behind proposers (engine) and objectives (training)."""

import pytest

from infer.proposers.base import PROPOSERS, Proposer, proposer_class
from infer.spec_config import SpeculativeConfig
from infer.foundation.registry import Registry
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
    assert {"ngram", "ngram_gpu", "suffix", "draft_model", "eagle", "eagle3", "eagle3/parallel",
            "dflash", "dspark", "mlp_speculator", "mtp"} <= set(PROPOSERS.names())
    assert set(OBJECTIVES.names()) == {"eagle", "eagle3", "peagle", "dflash", "dspark",
                                       "mlp_speculator", "pard", "mtp"}
    with pytest.raises(ValueError, match="serves: .*eagle3"):
        PROPOSERS.get("no_such_method")
    with pytest.raises(ValueError, match=r"'drafter.method': 'x'.*eagle3, mlp_speculator, mtp, pard"):
        OBJECTIVES.get("x")


def test_proposer_class_follows_parallel_drafting():
    """``METHOD/parallel`` serves parallel drafting where registered; a proposer that handles
    the flag itself (draft_model: PARD) serves both; a chain-only one refuses the flag instead of
    silently drafting chains."""
    def spec(**kw):
        return SpeculativeConfig(num_speculative_tokens=3, **kw)

    assert proposer_class(spec(method="draft_model", model="m")).name == "draft_model"
    assert proposer_class(spec(method="draft_model", model="m",
                               parallel_drafting=True)).name == "draft_model"
    assert proposer_class(spec(method="eagle", model="m")).name == "eagle"
    with pytest.raises(ValueError, match=r"'parallel_drafting'.*'eagle'.*draft_model"):
        proposer_class(spec(method="eagle", model="m", parallel_drafting=True))
    assert proposer_class(spec(method="ngram_gpu")).name == "ngram_gpu"
