"""SamplingParams validation and the sampling functions (temperature, top-k, top-p, sampling)."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from infer.sampling import (SamplingParams, apply_top_k_top_p, logits_to_probs,
                            sample_from_probs)

# ---- SamplingParams -------------------------------------------------------------------------

GOOD_PARAMS = [
    ({}, {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "greedy": False, "top_k_enabled": False}),
    ({"temperature": 0}, {"greedy": True}),
    ({"temperature": 0.7, "top_p": 0.9, "top_k": 50}, {"top_k_enabled": True, "top_p": 0.9}),
    ({"top_k": -1}, {"top_k_enabled": False}),
    ({"max_tokens": 8, "min_tokens": 8}, {"min_tokens": 8}),
    ({"seed": 0, "ignore_eos": True}, {"seed": 0, "ignore_eos": True}),
    ({"stop_token_ids": (2, 0)}, {"stop_token_ids": [2, 0]}),
]

# (kwargs, substrings of the error: the key, the value, what is allowed)
BAD_PARAMS = [
    ({"temperature": -0.1}, ["'temperature'", "-0.1", "[0.0, inf]"]),
    ({"temperature": "hot"}, ["'temperature'", "'hot'", "a number"]),
    ({"temperature": math.inf}, ["'temperature'", "inf", "finite"]),
    ({"temperature": math.nan}, ["'temperature'", "nan"]),
    ({"top_p": 0.0}, ["'top_p'", "0.0", "(0.0, 1.0]"]),
    ({"top_p": 1.5}, ["'top_p'", "1.5", "(0.0, 1.0]"]),
    ({"top_k": -2}, ["'top_k'", "-2", ">= -1"]),
    ({"top_k": 2.5}, ["'top_k'", "2.5", "an integer"]),
    ({"max_tokens": 0}, ["'max_tokens'", "0", ">= 1"]),
    ({"min_tokens": -1}, ["'min_tokens'", "-1", ">= 0"]),
    ({"max_tokens": 4, "min_tokens": 5}, ["'min_tokens'", "5", "<= max_tokens (4)"]),
    ({"seed": "x"}, ["'seed'", "'x'", "an integer or None"]),
    ({"stop_token_ids": [-1]}, ["'stop_token_ids'", "[-1]", "non-negative token ids"]),
    ({"stop_token_ids": "1,2"}, ["'stop_token_ids'", "'1,2'", "list"]),
    ({"stop_token_ids": [True]}, ["'stop_token_ids'", "[True]"]),
    ({"ignore_eos": "no"}, ["'ignore_eos'", "'no'", "true or false"]),
    ({"n": 2}, ["'n'", "2", "1 (one output"]),
    ({"n": True}, ["'n'", "True", "an integer"]),
]


@pytest.mark.parametrize("kwargs, expected", GOOD_PARAMS)
def test_sampling_params_good(kwargs, expected):
    params = SamplingParams(**kwargs)
    for key, value in expected.items():
        assert getattr(params, key) == value, key
    assert SamplingParams.from_dict(params.to_dict()) == params


@pytest.mark.parametrize("kwargs, fragments", BAD_PARAMS)
def test_sampling_params_bad(kwargs, fragments):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    with pytest.raises(ValueError):
        SamplingParams.from_dict(kwargs)


def test_from_dict_unknown_key():
    with pytest.raises(ValueError, match=r"unknown key 'temprature'; allowed keys: .*temperature"):
        SamplingParams.from_dict({"temprature": 0.5})


@pytest.mark.parametrize("key", ["num_speculative_tokens", "method", "model",
                                 "parallel_drafting"])
def test_from_dict_speculative_key_hint(key):
    with pytest.raises(ValueError, match=rf"'{key}'.*belongs in speculative_config"):
        SamplingParams.from_dict({key: 3})


def test_validate_catches_changes_after_construction():
    """A dataclass field can be assigned anything; validate() (run again by LLM.generate)
    names what changed."""
    params = SamplingParams()
    params.top_p = 2
    with pytest.raises(ValueError, match=r"'top_p': 2; expected a number in \(0.0, 1.0\]"):
        params.validate()
    params.top_p, params.stop_token_ids = 0.5, (4, 5)
    params.validate()
    assert params.stop_token_ids == [4, 5]


def test_from_dict_copies_an_instance():
    """The typed config's sampling node arrives as an instance: from_dict validates a copy."""
    params = SamplingParams(temperature=0.5, stop_token_ids=[3])
    copy = SamplingParams.from_dict(params)
    assert copy == params and copy is not params
    assert copy.stop_token_ids is not params.stop_token_ids
    params.temperature = -1.0
    with pytest.raises(ValueError, match="'temperature': -1.0"):
        SamplingParams.from_dict(params)


def test_from_dict_none_and_omegaconf():
    assert SamplingParams.from_dict(None) == SamplingParams()
    cfg = OmegaConf.create({"t": 0.5, "s": {"temperature": "${t}", "stop_token_ids": [1, 2]}})
    params = SamplingParams.from_dict(cfg.s)
    assert (params.temperature, params.stop_token_ids) == (0.5, [1, 2])
    assert type(params.stop_token_ids) is list


# ---- temperature, top-k, top-p --------------------------------------------------------------

def _logits(batch=3, vocab=11, seed=0):
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_scales_logits(temperature):
    logits = _logits()
    probs = logits_to_probs(logits, temperature)
    torch.testing.assert_close(probs, (logits / temperature).softmax(-1))
    assert probs.dtype == torch.float32


def test_greedy_rows_are_one_hot():
    logits = _logits()
    probs = logits_to_probs(logits, 0.0, top_k=3, top_p=0.5)
    torch.testing.assert_close(probs, torch.nn.functional.one_hot(logits.argmax(-1), 11).float())


def test_per_row_temperature():
    logits = _logits(batch=3)
    temp = torch.tensor([0.0, 1.0, 2.0])
    probs = logits_to_probs(logits, temp)
    assert probs[0].sum() == 1 and probs[0, logits[0].argmax()] == 1  # one-hot row
    torch.testing.assert_close(probs[1], logits[1].softmax(-1))
    torch.testing.assert_close(probs[2], (logits[2] / 2).softmax(-1))


def test_per_row_temperature_on_draft_positions():
    logits = torch.randn(2, 4, 7)  # [batch, k + 1, vocab]
    probs = logits_to_probs(logits, torch.tensor([0.0, 0.5]), top_k=torch.tensor([0, 2]))
    torch.testing.assert_close(probs[0], torch.nn.functional.one_hot(logits[0].argmax(-1), 7)
                               .float())
    assert ((probs[1] > 0).sum(-1) == 2).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4))


def test_half_logits_give_fp32_probs():
    probs = logits_to_probs(_logits().half(), 1.0)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_top_k():
    logits = _logits()
    probs = logits_to_probs(logits, 1.0, top_k=2)
    assert ((probs > 0).sum(-1) == 2).all()
    top2 = logits.topk(2, dim=-1)
    expected = torch.zeros_like(probs).scatter_(-1, top2.indices, top2.values.softmax(-1))
    torch.testing.assert_close(probs, expected)


def test_top_k_per_row_and_disabled():
    logits = _logits(batch=4)
    probs = logits_to_probs(logits, 1.0, top_k=torch.tensor([1, 0, 3, 100]))
    assert (probs > 0).sum(-1).tolist() == [1, 11, 3, 11]  # 0 disables, > vocab keeps all
    assert apply_top_k_top_p(logits) is logits  # nothing to do


def test_top_p():
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = base.log().repeat(4, 1)
    probs = logits_to_probs(logits, 1.0, top_p=torch.tensor([0.01, 0.75, 0.85, 1.0]))
    assert (probs > 0).sum(-1).tolist() == [1, 2, 3, 4]
    torch.testing.assert_close(probs[1], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(probs[3], base)
    scalar = logits_to_probs(logits[:1], 1.0, top_p=0.75)
    torch.testing.assert_close(scalar[0], probs[1])


def test_top_p_one_keeps_a_tiny_tail():
    # fp32 cumsum reaches 1.0 before the tail; top_p = 1.0 must still keep every token
    logits = torch.tensor([[30.0, 0.0, -1.0, 1.0]])
    assert torch.isfinite(apply_top_k_top_p(logits, top_p=1.0)).all()
    assert torch.isfinite(apply_top_k_top_p(logits, top_p=torch.tensor([1.0]))).all()
    big = torch.randn(2, 32000) * 3
    assert torch.isfinite(apply_top_k_top_p(big, top_p=1.0)).all()


def test_top_k_then_top_p():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().unsqueeze(0)
    # top-k 3 renormalises to [4/9, 3/9, 2/9]; top-p 0.7 then keeps the first two
    probs = logits_to_probs(logits, 1.0, top_k=3, top_p=0.7)
    torch.testing.assert_close(probs[0], torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))


def test_filters_do_not_move_tokens():
    logits = _logits(batch=2, vocab=50)
    filtered = apply_top_k_top_p(logits, top_k=10, top_p=0.9)
    kept = torch.isfinite(filtered)
    assert torch.equal(filtered[kept], logits[kept])
    assert kept.any(-1).all()


# ---- sampling -------------------------------------------------------------------------------

def test_sample_from_probs_matches_probs():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    n = 200_000
    gen = torch.Generator().manual_seed(1234)
    samples = sample_from_probs(probs.expand(n, 5), generator=gen)  # [n]
    assert samples.shape == (n,)
    freq = torch.bincount(samples, minlength=5).float() / n
    assert freq[4] == 0  # zero-probability tokens are never drawn
    # binomial std is at most sqrt(0.25 / n) ~ 0.0011; allow ~5 sigma
    torch.testing.assert_close(freq, probs, atol=6e-3, rtol=0)


def test_sample_from_probs_per_row_and_shape():
    probs = torch.tensor([[0.9, 0.1, 0.0], [0.0, 0.0, 1.0], [0.2, 0.3, 0.5]])
    n = 50_000
    gen = torch.Generator().manual_seed(7)
    samples = sample_from_probs(probs.unsqueeze(1).expand(3, n, 3), generator=gen)  # [3, n]
    assert samples.shape == (3, n)
    freq = torch.stack([torch.bincount(row, minlength=3) for row in samples]).float() / n
    torch.testing.assert_close(freq, probs, atol=1e-2, rtol=0)


def test_sample_from_probs_is_seeded_and_greedy_exact():
    probs = logits_to_probs(_logits(batch=8, vocab=100), 1.0)
    a = sample_from_probs(probs, torch.Generator().manual_seed(3))
    b = sample_from_probs(probs, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    logits = _logits(batch=8, vocab=100)
    one_hot = logits_to_probs(logits, 0.0)
    for seed in range(5):
        drawn = sample_from_probs(one_hot, torch.Generator().manual_seed(seed))
        assert torch.equal(drawn, logits.argmax(-1))
