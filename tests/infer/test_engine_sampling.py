"""Sampling through the engine reproduces the target's distribution (speculative or not).

Tiny vocabulary (8), one prompt copied N times in one ``generate`` call (each row draws its own
noise). The exact law of the first two output tokens, P(t1, t2) = p(t1) p(t2 | t1), and of the
third token's marginal come from transformers' forward of the target. Token 1 is sampled at
prefill; tokens 2 and 3 come from the first speculative step (k = 2 drafts), so they go through
accepted / recovered / bonus tokens. A chi-square test per law; the sample is seeded, so the
test is deterministic. The same statistic must reject the law a broken sampler that emits the
draft's distribution would produce (the test has power).
"""

import numpy as np
import pytest
import torch
from scipy.stats import chi2
from transformers import LlamaForCausalLM

from infer.engine import LLM
from infer.sampling import SamplingParams, logits_to_probs
from .conftest import price_verification

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 8
PROMPT = [1, 2, 3, 1, 2]  # repetitive, so n-gram drafting proposes too
N = 4000
K = 2
P_MIN = 1e-3


@pytest.fixture(scope="module")
def models(make_tiny_llama):
    # init scale 0.15: flat-ish distributions; the draft agrees with the target ~half the time
    target = make_tiny_llama("sampling_target", vocab=VOCAB, seed=3, std=0.15)
    draft = make_tiny_llama("sampling_draft", vocab=VOCAB, hidden=16, layers=1, heads=2,
                            kv_heads=1, seed=4, std=0.15)
    pard = make_tiny_llama("sampling_pard", vocab=VOCAB, hidden=16, layers=1, heads=2,
                           kv_heads=1, seed=5, std=0.15, extra_config={"pard_token": VOCAB - 1})
    return target, draft, pard


def exact_laws(model_dir, temperature, top_k, top_p):
    """P(t1, t2) ``[V, V]`` and P(t3) ``[V]`` of the model under the sampling transform
    (``model_dir``: a Llama directory, or a loaded transformers model)."""
    model = model_dir if isinstance(model_dir, torch.nn.Module) else \
        LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def next_token(seqs):
        with torch.no_grad():
            logits = model(torch.tensor(seqs)).logits[:, -1]  # [n, V]
        return logits_to_probs(logits, temperature, top_k, top_p).double()

    p1 = next_token([PROMPT])[0]  # [V]
    p2 = next_token([PROMPT + [a] for a in range(VOCAB)])  # [V, V]: p(t2 = b | t1 = a)
    p3 = next_token([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    joint = p1[:, None] * p2
    third = (joint[..., None] * p3.view(VOCAB, VOCAB, VOCAB)).sum(dim=(0, 1))
    return joint.numpy(), third.numpy()


def chi2_pvalue(counts, probs, min_expected=5.0):
    """Pearson chi-square goodness of fit; cells expecting < 5 are pooled into one."""
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    if counts[probs <= 0].sum() > 0:  # a token the law cannot produce
        return 0.0
    expected = probs * counts.sum()
    small = expected < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] <= 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(chi2.sf(stat, len(obs) - 1))


def sample(target, spec, temperature=1.0, top_k=0, top_p=1.0, seed=1234):
    llm = LLM(target, speculative_config=spec, dtype="float32", max_num_seqs=N,
              max_model_len=16, seed=seed)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=K + 2)
    outs = llm.generate([PROMPT] * N, params)
    tokens = np.array([o.token_ids for o in outs])  # [N, K + 2]: no EOS, all full length
    joint = np.bincount(tokens[:, 0] * VOCAB + tokens[:, 1], minlength=VOCAB * VOCAB)
    third = np.bincount(tokens[:, 2], minlength=VOCAB)
    return joint, third, llm.get_metrics()


SPECS = {
    "none": None,
    "draft_probabilistic": {"method": "draft_model", "rejection_sample_method": "probabilistic"},
    "draft_strict": {"method": "draft_model", "rejection_sample_method": "strict"},
    "pard_probabilistic": {"method": "draft_model", "parallel_drafting": True,
                           "rejection_sample_method": "probabilistic"},
    "ngram_probabilistic": {"method": "ngram", "rejection_sample_method": "probabilistic",
                            "prompt_lookup_min": 1, "prompt_lookup_max": 2},
    # block verification: sampled drafts with their probabilities, and greedy ones (one-hot q)
    "draft_block_sampled": {"method": "draft_model", "rejection_sample_method": "block",
                            "draft_sample_method": "probabilistic"},
    "draft_block_greedy": {"method": "draft_model", "rejection_sample_method": "block"},
    # adaptive verification: each row verifies a prefix of its drafts chosen from the drafter's
    # confidences and the measured costs (infer/adaptive.py)
    "draft_adaptive": {"method": "draft_model", "rejection_sample_method": "probabilistic",
                       "enable_adaptive_verification": True},
}


@pytest.mark.parametrize("name", list(SPECS))
def test_output_distribution_matches_target(models, name, monkeypatch):
    target, draft, pard = models
    if name == "draft_adaptive":  # one draft pays while its survival beats 0.1, two do not
        price_verification(monkeypatch, [1.0, 1.1, 1.9])  # (unless the 2nd's beats ~0.7)
    spec = SPECS[name] and {**SPECS[name], "num_speculative_tokens": K}
    if spec and spec["method"] == "draft_model":
        spec["model"] = pard if spec.get("parallel_drafting") else draft
    joint, third, metrics = sample(target, spec)
    p_joint, p_third = exact_laws(target, 1.0, None, None)
    assert chi2_pvalue(joint, p_joint) > P_MIN
    assert chi2_pvalue(third, p_third) > P_MIN
    if spec:  # the speculative paths really ran: drafts both accepted and rejected
        assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"], metrics
    if name == "draft_adaptive":  # and some rows verified fewer than the K drafts they drew
        assert metrics["num_draft_tokens"] < K * metrics["num_drafts"], metrics
    if name == "draft_probabilistic":  # power: emitting the draft's t2 law would be caught
        q_joint, _ = exact_laws(draft, 1.0, None, None)
        q_cond = q_joint / q_joint.sum(axis=1, keepdims=True)  # q(t2 | t1)
        wrong = p_joint.sum(axis=1, keepdims=True) * q_cond
        assert chi2_pvalue(joint, wrong) < 1e-6


@pytest.mark.parametrize("method", ["probabilistic", "strict", "block"])
def test_filtered_distribution_matches_target(models, method):
    """temperature / top-k / top-p shape the target law p (and the draft's q) the same way."""
    target, draft, _ = models
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": K,
            "rejection_sample_method": method}
    joint, third, metrics = sample(target, spec, temperature=0.7, top_k=5, top_p=0.9, seed=7)
    p_joint, p_third = exact_laws(target, 0.7, 5, 0.9)
    assert (p_joint == 0).any()  # the filters remove tokens, which must never be emitted
    assert chi2_pvalue(joint, p_joint) > P_MIN
    assert chi2_pvalue(third, p_third) > P_MIN
    assert metrics["num_accepted_tokens"] > 0


def test_vllm_spellings_run_the_same_sampler(models):
    """``standard`` + ``draft_sample_method`` (vLLM's newer spelling) is ``probabilistic`` /
    ``strict``: the same drafts, the same accept test, the same seeded outputs."""
    target, draft, _ = models
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=None)
    for old, new in (({"rejection_sample_method": "probabilistic"},
                      {"rejection_sample_method": "standard",
                       "draft_sample_method": "probabilistic"}),
                     ({"rejection_sample_method": "strict"},
                      {"rejection_sample_method": "standard"})):
        runs = [LLM(target, speculative_config={"method": "draft_model", "model": draft,
                                                "num_speculative_tokens": K, **spec},
                    max_num_seqs=4, seed=7).generate([PROMPT] * 4, params) for spec in (old, new)]
        assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
