"""Per-request seeds (``SamplingParams.seed``, vLLM semantics): a seeded request's sampled output
depends only on its prompt, parameters and seed, not on the engine seed, the batch it shares or
its slot; unseeded requests keep the engine's stream."""

import pytest
import torch

from infer.engine import LLM
from infer.rejection import draw_randomness
from infer.sampling import BatchGenerator, SamplingParams, sample_from_probs

from .conftest import ENGINE_PROMPTS

pytestmark = pytest.mark.usefixtures("single_thread")

SPECS = [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
         "draft", "pard"]


def _spec(spec, draft, pard):
    if spec in ("draft", "pard"):  # sampled drafts: [B, vocab] per step, or [B, k, vocab]
        return {"method": "draft_model", "model": draft if spec == "draft" else pard,
                "num_speculative_tokens": 3, "rejection_sample_method": "probabilistic",
                "parallel_drafting": spec == "pard"}
    return spec


def _sampled(seed=None, **kw):
    return SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=seed, **kw)


@pytest.mark.parametrize("spec", SPECS, ids=["autoregressive", "ngram", "draft_model", "pard"])
def test_seeded_request_ignores_batch_and_engine_seed(tiny_target, tiny_draft, pard_draft, spec):
    spec = _spec(spec, tiny_draft, pard_draft)
    alone = LLM(tiny_target, speculative_config=spec, seed=0, max_num_seqs=4)
    ref = alone.generate([ENGINE_PROMPTS[1]], _sampled(seed=42))[0].token_ids

    # other engine seed; the seeded request is third in a batch of unseeded neighbours
    # (different lengths), then admitted late into a freed slot of a two-slot engine
    crowd = LLM(tiny_target, speculative_config=spec, seed=123, max_num_seqs=4)
    batch = [ENGINE_PROMPTS[0], ENGINE_PROMPTS[2], ENGINE_PROMPTS[1], ENGINE_PROMPTS[3]]
    params = [_sampled(), _sampled(), _sampled(seed=42), _sampled()]
    assert crowd.generate(batch, params)[2].token_ids == ref
    small = LLM(tiny_target, speculative_config=spec, seed=7, max_num_seqs=2)
    assert small.generate(batch, params)[2].token_ids == ref

    other_seed = alone.generate([ENGINE_PROMPTS[1]], _sampled(seed=43))[0].token_ids
    assert other_seed != ref  # 12 tokens at temperature 1 over a 96-token vocabulary


def test_unseeded_rows_keep_the_engine_stream(tiny_target):
    """A seeded neighbour redraws only its own row: the others are what they were without it."""
    prompts = [ENGINE_PROMPTS[0], ENGINE_PROMPTS[1], ENGINE_PROMPTS[3]]
    plain = LLM(tiny_target, seed=5).generate(prompts, _sampled())
    mixed = LLM(tiny_target, seed=5).generate(prompts, [_sampled(), _sampled(seed=9), _sampled()])
    assert [mixed[0].token_ids, mixed[2].token_ids] == [plain[0].token_ids, plain[2].token_ids]
    assert mixed[1].token_ids != plain[1].token_ids


def test_batch_generator_rows_draw_from_their_own_stream():
    g_default = torch.Generator().manual_seed(0)
    rows = [None, torch.Generator().manual_seed(11), None]
    uniforms, noise = draw_randomness(3, 2, 5, torch.device("cpu"),
                                      BatchGenerator(g_default, rows))
    own = torch.Generator().manual_seed(11)
    assert torch.equal(uniforms[1], torch.rand(2, generator=own))
    assert torch.equal(noise[1], torch.rand(5, generator=own).neg_().log1p_().neg_()
                       .clamp_min_(1e-20))  # Exp(1) as -log(1 - U)
    plain_u, plain_n = draw_randomness(3, 2, 5, torch.device("cpu"),
                                       torch.Generator().manual_seed(0))
    assert torch.equal(uniforms[[0, 2]], plain_u[[0, 2]])
    assert torch.equal(noise[[0, 2]], plain_n[[0, 2]])

    probs = torch.full((2, 4, 7), 1 / 7)  # [batch, positions, vocab]: rows are independent
    a = sample_from_probs(probs, BatchGenerator(None, [torch.Generator().manual_seed(3), None]))
    b = sample_from_probs(probs[:1], torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0])


def test_all_seeded_batch_leaves_the_default_stream_alone():
    """No row reads the default stream when every row is seeded, so it is not drawn: the next
    unseeded draw is the one a fresh generator would make."""
    g_default = torch.Generator().manual_seed(0)
    seeded = BatchGenerator(g_default, [torch.Generator().manual_seed(4)])
    uniforms, _ = draw_randomness(1, 3, 5, torch.device("cpu"), seeded)
    assert torch.equal(uniforms[0], torch.rand(3, generator=torch.Generator().manual_seed(4)))
    assert torch.equal(torch.rand(3, generator=g_default),
                       torch.rand(3, generator=torch.Generator().manual_seed(0)))


def test_seeded_row_in_a_draft_sub_batch(tiny_target, tiny_draft):
    """Rows that cannot draft (past the draft's max_model_len) leave a sub-batch; a seeded row in
    it keeps its own stream."""
    spec = {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3,
            "rejection_sample_method": "probabilistic", "max_model_len": 24}
    long_prompt = list(range(30, 55))  # 25 tokens: never fits the draft, never drafts
    ref = LLM(tiny_target, speculative_config=spec, seed=0).generate(
        [ENGINE_PROMPTS[1]], _sampled(seed=42))[0]
    outs = LLM(tiny_target, speculative_config=spec, seed=1).generate(
        [long_prompt, ENGINE_PROMPTS[1]], [_sampled(), _sampled(seed=42)])
    assert outs[1].token_ids == ref.token_ids
    assert outs[0].metrics["num_drafts"] == 0 and outs[1].metrics["num_drafts"] > 0
