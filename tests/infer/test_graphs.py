"""Static-shape forwards (infer/graphs.py): the fixed row / key layout, buffers, warm-up undo and
output order against the plain cached forward, on CPU (capture=False runs the same function the
CUDA graph would record), and through the engine."""

import pytest
import torch

import infer.graphs
from infer.engine import LLM
from infer.graphs import MIN_KV_BUCKET, StaticForward, kv_bucket, row_sizes
from infer.kv_cache import KVCache
from infer.models.loader import load_model
from infer.sampling import SamplingParams

from .conftest import ENGINE_PROMPTS

pytestmark = pytest.mark.usefixtures("single_thread")


def test_row_sizes_and_kv_buckets():
    assert row_sizes(1) == (1,)
    assert row_sizes(5) == (1, 2, 4, 5)
    assert row_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert kv_bucket(3, 4097) == MIN_KV_BUCKET
    assert kv_bucket(MIN_KV_BUCKET + 1, 4097) == 2 * MIN_KV_BUCKET
    assert kv_bucket(3000, 4097) == 4096 and kv_bucket(4097, 4097) == 4097
    assert kv_bucket(3, 100) == 100  # never past the cache


def _prefilled(model, lengths):
    """A cache of 5 rows with rows 0, 1, 3 prefilled to ``lengths`` (row 2 and 4 free)."""
    cfg = model.config
    cache = KVCache.for_model(cfg, 5, 600)  # keys read: a 256 bucket, not all 601
    gen = torch.Generator().manual_seed(0)
    for slot, n in zip((0, 1, 3), lengths):
        ids = torch.randint(cfg.vocab_size, (1, n), generator=gen)
        model(ids, cache, torch.tensor([slot]))
    return cache


def _clone(cache):
    copy = KVCache(cache.k.shape[0], cache.max_batch, cache.k.shape[2], cache.max_len,
                   cache.k.shape[4])
    copy.k.copy_(cache.k)
    copy.v.copy_(cache.v)
    copy.lens.copy_(cache.lens)
    return copy


@torch.no_grad()
def test_static_forward_equals_the_plain_forward(tiny_target):
    model = load_model(tiny_target, dtype=torch.float32, device="cpu")
    plain = _prefilled(model, (5, 9, 3))
    static = _clone(plain)
    runner = StaticForward(model, static, capture=False, aux_layer_ids=(1, 2))
    gen = torch.Generator().manual_seed(1)
    # several steps: lengths and keys must stay in step; the last as if slot 1 had finished
    for slots, num in [([3, 0, 1], [4, 1, 3])] * 3 + [([3, 0], [2, 4])]:
        # out of order, row 2 free between them; ragged: padding tokens in some rows
        num = torch.tensor(num)
        ids = torch.randint(model.config.vocab_size, (len(slots), 4), generator=gen)  # [B, k+1]
        want = model(ids, plain, torch.tensor(slots), num_tokens=num, aux_layer_ids=(1, 2))
        longest = int((plain.lens[slots]).max())  # after the step: what the engine bounds
        got = runner(ids, slots=slots, index=torch.tensor(slots), num_tokens=num,
                     max_len=longest)
        for row, n in enumerate(num.tolist()):  # padding outputs are garbage on both sides
            for a, b in zip((got.logits, got.hidden, *got.aux), (want.logits, want.hidden,
                                                                 *want.aux)):
                # other batch rows and key lengths: float sums in another order
                torch.testing.assert_close(a[row, :n], b[row, :n], rtol=1e-4, atol=1e-4)
        assert static.lens.tolist() == plain.lens.tolist()  # warm-up advance undone
        for slot in slots:
            n = int(plain.lens[slot])
            for a, b in ((static.k, plain.k), (static.v, plain.v)):
                torch.testing.assert_close(a[:, slot, :, :n], b[:, slot, :, :n], rtol=1e-4,
                                           atol=1e-4)
        plain.truncate(torch.tensor([0]), plain.lens[0] - 1)  # a rollback between steps
        static.truncate(torch.tensor([0]), static.lens[0] - 1)
    assert set(runner.graphs) == {(4, 4, MIN_KV_BUCKET)}  # one shape: slot 3 -> 4 rows


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 1}, "draft"],
                         ids=["autoregressive", "ngram", "draft_model"])
def test_engine_static_steps_are_lossless(tiny_target, tiny_draft, spec, monkeypatch):
    """Greedy output through the static path equals the plain engine's, with continuous batching
    (2 slots for 4 requests: finished slots are refilled, rows go out of order)."""
    if spec == "draft":
        spec = {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 2}
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (12, 5, 9, 7)]
    plain = LLM(tiny_target, speculative_config=spec, max_num_seqs=2, device="cpu")
    want = plain.generate(ENGINE_PROMPTS, params)
    # what LLM(device="cuda") sets up, with the graphs run eagerly
    monkeypatch.setattr(LLM, "_static_steps", property(lambda self: True))
    monkeypatch.setattr(infer.graphs, "MIN_KV_BUCKET", 1)  # key buckets below the cache size
    static = LLM(tiny_target, speculative_config=spec, max_num_seqs=2, device="cpu")
    got = static.generate(ENGINE_PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert static.get_metrics() == plain.get_metrics()
    assert static.runner.static_forward.graphs  # the static path ran
    if spec and spec["method"] == "draft_model":
        assert static.proposer.static.graphs  # and drafted


def test_engine_uses_static_steps_only_on_cuda_unless_eager(tiny_target):
    llm = LLM(tiny_target, device="cpu")
    assert llm.runner.static_forward is None  # CPU: the plain forward (exact key length)
    if torch.cuda.is_available():
        assert LLM(tiny_target, device="cuda").runner.static_forward is not None
        assert LLM(tiny_target, device="cuda", enforce_eager=True).runner.static_forward is None
