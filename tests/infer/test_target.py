"""A loaded ``Target`` is shared by engines instead of reloaded; what it fixed stays fixed."""

import pytest
import torch

from infer.engine import LLM
from infer.target import Target


def test_engines_share_a_loaded_target(tiny_target):
    target = Target.load(tiny_target, device="cpu", max_model_len=64)
    a = LLM(target, max_num_seqs=1)
    b = LLM(target, {"method": "ngram", "num_speculative_tokens": 2}, max_num_seqs=2)
    assert a.target is b.target and a.max_model_len == b.max_model_len == 64
    assert a.cache is not b.cache and a.tokenizer is target.tokenizer
    assert a.target.dtype == torch.float32
    with pytest.raises(ValueError, match=r"'dtype': 'bfloat16'; expected 'auto' when a loaded "
                                         r"Target is passed"):
        LLM(target, dtype="bfloat16")
    with pytest.raises(ValueError, match="'max_model_len'"):
        LLM(target, max_model_len=32)


def test_harness_runs_on_a_loaded_target(tiny_target):
    from infer.eval.harness import expand_matrix, run_harness
    from infer.eval.options import HarnessOptions

    target = Target.load(tiny_target, device="cpu")
    matrix = expand_matrix([{"method": "ngram", "prompt_lookup_min": 1}], [2])
    report = run_harness(target, matrix, [[5, 6, 7, 5, 6, 7]],
                         HarnessOptions(max_tokens=4, warmup=False))
    assert report.target == tiny_target and report.results[0].lossless is True
    with pytest.raises(ValueError, match="'device': 'cpu'; expected 'auto' when a loaded"):
        run_harness(target, matrix, [[5, 6]], HarnessOptions(max_tokens=4, device="cpu"))


def test_target_tokens_make_the_engines_requests(tiny_target):
    """Without the weights (the harness on vLLM) prompts become the same requests, refused for
    the same reasons, as with the loaded target."""
    from infer.request import make_requests
    from infer.sampling_params import SamplingParams
    from infer.target import TargetTokens

    loaded = Target.load(tiny_target, device="cpu", max_model_len=16)
    tokens = TargetTokens.load(tiny_target, max_model_len=16)
    assert (tokens.vocab_size, tokens.max_model_len, tokens.eos_ids) == (
        loaded.vocab_size, loaded.max_model_len, loaded.eos_ids)
    prompts = [[1, 2, 3], [5, 96], list(range(1, 17)), {"prompt_token_ids": [7, 8]}]
    params = SamplingParams(max_tokens=4, stop_token_ids=[9])
    a, b = make_requests(prompts, params, loaded), make_requests(prompts, params, tokens)
    assert [(r.prompt_ids, r.error) for r in a] == [(r.prompt_ids, r.error) for r in b]
    assert [r.error is None for r in b] == [True, False, False, True]
    with pytest.raises(ValueError, match="'max_model_len': 512"):
        TargetTokens.load(tiny_target, max_model_len=512)
