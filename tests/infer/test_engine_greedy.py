"""Greedy engine tests (fp32, tiny random Llamas on CPU).

- Speculative output is token-identical to non-speculative output of the same engine for every
  proposer (random draft, a draft identical to the target, PARD, n-gram, suffix), batch 1 and 4
  with different prompt lengths, k in {1, 3, 5}; and with continuous batching.
- Non-speculative (and speculative) output equals transformers' ``generate``.
- Stop conditions: EOS inside an accepted prefix, max_tokens / max_model_len cutting what a step
  could emit, min_tokens, stop_token_ids; and the metrics each leaves behind.
"""

import pytest
import torch
from transformers import (AutoModelForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from infer.engine import LLM
from infer.metrics import SpecMetrics
from infer.proposers.base import PROPOSERS
from infer.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

K_VALUES = (1, 3, 5)
MAX_TOKENS = 12
# The loopy target's greedy continuations of these repeat, so n-gram / suffix drafts hit.
LOOPY_PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6, 7], [20, 21, 20, 21, 20, 21], [4, 5, 6, 7, 8], [9]]
LOOPY_MAX_TOKENS = 24
SETUPS = ("draft_model", "twin", "pard", "ngram", "suffix")


# ---- helpers -------------------------------------------------------------------------------------

def served(method):
    try:
        PROPOSERS.get(method)
    except ValueError:
        return False
    return True


def greedy(max_tokens=MAX_TOKENS, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def token_ids(outputs):
    return [o.token_ids for o in outputs]


def generate(model, prompts, params, spec=None, **llm_kwargs):
    llm_kwargs.setdefault("max_num_seqs", len(prompts))
    llm = LLM(model, speculative_config=spec, dtype="float32", **llm_kwargs)
    return llm, llm.generate(prompts, params)


_REFERENCE = {}


def reference(model, prompts, max_tokens, **params):
    """Non-speculative greedy outputs of the engine (cached per model / prompts / params)."""
    key = (model, tuple(map(tuple, prompts)), max_tokens, tuple(sorted(params.items())))
    if key not in _REFERENCE:
        _REFERENCE[key] = token_ids(generate(model, prompts, greedy(max_tokens, **params))[1])
    return _REFERENCE[key]


def draft_spec(draft, k, **extra):
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, **extra}


def hf_generate(model_dir, prompts, max_new_tokens, **kwargs):
    """transformers' greedy generate, one prompt at a time (no padding involved)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0, **kwargs)
            outs.append(out[0, len(p):].tolist())
    return outs


def check_metrics(m, k):
    """The definitions (docs/reference.md §3) and the consistency of the counters."""
    drafts, drafted, accepted = m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"]
    per_pos = m["num_accepted_tokens_per_pos"]
    assert drafts <= drafted <= k * drafts
    assert 0 <= accepted <= drafted
    assert len(per_pos) <= k
    assert sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos  # non-increasing
    assert not per_pos or per_pos[0] <= drafts
    if drafts:
        assert m["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
        assert m["acceptance_rate"] == pytest.approx(accepted / drafted)
        assert m["per_position_rates"] == pytest.approx([c / drafts for c in per_pos])
    else:
        assert (m["mean_acceptance_length"], m["acceptance_rate"]) == (1.0, 0.0)


def check_engine_metrics(llm, outputs, k):
    """Per-request metrics are consistent and add up to the engine's ``get_metrics()``."""
    total = SpecMetrics()
    for out in outputs:
        check_metrics(out.metrics, k)
        total.merge(SpecMetrics(out.metrics["num_drafts"], out.metrics["num_draft_tokens"],
                                out.metrics["num_accepted_tokens"],
                                list(out.metrics["num_accepted_tokens_per_pos"])))
    metrics = llm.get_metrics()
    check_metrics(metrics, k)
    assert metrics == total.as_dict()
    return metrics


def twin_metrics(full, k, max_tokens, stop=(), prompt_len=0, max_model_len=10**9):
    """What a draft identical to the target must record under greedy decoding: every draft is
    accepted; drafts are clipped so every emitted token fits max_tokens and the cache; tokens
    after a stop token / the length limit are not emitted and not counted.

    ``full``: the greedy continuation without stop tokens (long enough)."""
    m = SpecMetrics()
    out = 1  # the prefill token
    if full[0] in stop:
        return m
    while out < max_tokens and prompt_len + out < max_model_len:
        n = max(0, min(k, max_tokens - out - 1, max_model_len - prompt_len - out))
        emitted = full[out: out + n + 1]
        kept, stopped = len(emitted), False
        for i, tok in enumerate(emitted):
            if tok in stop:
                kept, stopped = i + 1, True
                break
            if out + i + 1 >= max_tokens or prompt_len + out + i + 1 >= max_model_len:
                kept = i + 1
                break
        m.record(n, min(n, kept))
        out += kept
        if stopped:
            break
    return m


@pytest.fixture(scope="module")
def case(tiny_target, tiny_draft, twin_draft, pard_draft, loopy_target, engine_prompts):
    """``case(proposer, k)`` -> (target, prompts, max_tokens, speculative_config)."""

    def make(proposer, k):
        if proposer in ("ngram", "suffix"):
            if not served(proposer):
                pytest.skip(f"the {proposer} proposer is not present")
            spec = {"method": proposer, "num_speculative_tokens": k}
            if proposer == "ngram":
                spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
            return loopy_target, LOOPY_PROMPTS, LOOPY_MAX_TOKENS, spec
        draft = {"draft_model": tiny_draft, "twin": twin_draft, "pard": pard_draft}[proposer]
        spec = draft_spec(draft, k, parallel_drafting=proposer == "pard")
        return tiny_target, engine_prompts, MAX_TOKENS, spec

    return make


# ---- speculative == non-speculative ------------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("k", K_VALUES)
@pytest.mark.parametrize("proposer", SETUPS)
def test_speculative_equals_non_speculative(case, proposer, k, batch):
    target, prompts, max_tokens, spec = case(proposer, k)
    prompts = prompts[:batch]
    llm, outs = generate(target, prompts, greedy(max_tokens), spec)
    assert token_ids(outs) == reference(target, prompts, max_tokens)
    assert all(o.finish_reason == "length" and len(o.token_ids) == max_tokens for o in outs)
    assert [o.request_id for o in outs] == list(range(batch))
    m = check_engine_metrics(llm, outs, k)
    assert m["num_draft_tokens"] > 0, f"{proposer} never proposed"
    if proposer == "twin":  # drafts are clipped to max_tokens, so none is ever cut: rate 1.0
        assert m["acceptance_rate"] == 1.0
        for out, full in zip(outs, reference(target, prompts, max_tokens)):
            assert out.metrics == twin_metrics(full, k, max_tokens).as_dict()
    elif proposer == "pard":  # draft 1 comes from the real context with the target's weights
        assert m["num_accepted_tokens_per_pos"][0] == m["num_drafts"]
    elif proposer in ("ngram", "suffix"):
        assert m["num_accepted_tokens"] > 0, f"{proposer} drafts were never accepted: {m}"


@pytest.mark.parametrize("proposer", [None, "twin", "draft_model", "pard", "ngram", "suffix"])
def test_continuous_batching(case, proposer):
    """6 requests, 2 slots, different max_tokens: requests finish independently and waiting ones
    take the freed slots; every output equals the prompt decoded alone."""
    target, prompts, _, spec = case(proposer or "twin", 3)
    spec = spec if proposer else None
    prompts = prompts + [prompts[0][::-1] + [3], prompts[1][:2]]
    max_tokens = [5, 12, 1, 9, 3, 7]
    llm = LLM(target, speculative_config=spec, dtype="float32", max_num_seqs=2)
    running, after, step = [], [], llm.speculative_step

    def spy():
        running.append(sorted(r.slot for r in llm.scheduler.running))
        waiting = llm.num_waiting
        assert not any(r.finished for r in llm.scheduler.running), "a finished request was stepped"
        step()
        # requests admitted inside the step (eager steps prefill them in its verify forward)
        after.append((waiting, sorted(r.slot for r in llm.scheduler.running)))

    llm.speculative_step = spy
    outs = llm.generate(prompts, [greedy(m) for m in max_tokens])
    alone = [reference(target, [p], 12)[0] for p in prompts]
    assert token_ids(outs) == [a[:m] for a, m in zip(alone, max_tokens)]
    assert all(o.finish_reason == "length" for o in outs)
    assert all(set(slots) <= {0, 1} for slots in running)
    assert running[0] == [0, 1]
    # a free slot is refilled at once while requests wait: no step ends with a free slot and a
    # request still waiting from before it
    assert all(slots == [0, 1] for waiting, slots in after if waiting)
    assert any(len(slots) < 2 for slots in running), "no slot ever freed: the test tests nothing"
    check_engine_metrics(llm, outs, 3)
    assert llm.generate(prompts[:1], greedy(5))[0].token_ids == alone[0][:5]  # engine reusable


class _PrefillApart(LLM):
    """The engine with every prompt prefilled in a forward of its own, before the step."""

    _groups_prompts = property(lambda self: False)


@pytest.mark.parametrize("proposer", [None, "twin", "pard", "suffix"])
def test_waiting_prompts_are_prefilled_inside_the_running_batchs_verify(case, proposer):
    """While requests run, a freed slot's next prompt goes into the step's verify forward (as a
    group of its own: no prefill forward, no padding) and every output still equals the prompt
    decoded alone, and what prefill forwards apart give."""
    target, prompts, _, spec = case(proposer or "twin", 3)
    spec = spec if proposer else None
    prompts = prompts + [prompts[0][::-1] + [3], prompts[1][:2]]
    params = [greedy(m) for m in [5, 12, 1, 9, 3, 7]]
    llm = LLM(target, speculative_config=spec, dtype="float32", max_num_seqs=2)
    inside, apart = [], []
    verify, prefill = llm.runner.verify, llm.runner.prefill

    def spy_verify(inputs, reqs, slots, num_tokens, new):
        inside.extend(len(r.prompt_ids) for r in new)
        return verify(inputs, reqs, slots, num_tokens, new)

    def spy_prefill(reqs):
        apart.append([len(r.prompt_ids) for r in reqs])
        return prefill(reqs)
    llm.runner.verify, llm.runner.prefill = spy_verify, spy_prefill
    outs = llm.generate(prompts, params)
    alone = [reference(target, [p], 12)[0] for p in prompts]
    assert token_ids(outs) == [a[:p.max_tokens] for a, p in zip(alone, params)]
    assert apart[0] == [len(p) for p in prompts[:2]]  # nothing ran yet: one forward for both
    assert inside, "no prompt joined a running batch's verify forward"
    assert sorted(inside + sum(apart[1:], [])) == sorted(len(p) for p in prompts[2:])
    base = _PrefillApart(target, speculative_config=spec, dtype="float32", max_num_seqs=2)
    assert token_ids(base.generate(prompts, params)) == token_ids(outs)


# ---- transformers ------------------------------------------------------------------------------

def test_matches_transformers_generate(tiny_target, tiny_draft, engine_prompts):
    n = 16
    expected = hf_generate(tiny_target, engine_prompts, n)
    assert reference(tiny_target, engine_prompts, n) == expected
    _, outs = generate(tiny_target, engine_prompts, greedy(n), draft_spec(tiny_draft, 3))
    assert token_ids(outs) == expected


def test_matches_transformers_generate_with_eos(eos_target, twin_draft, engine_prompts):
    target, eos = eos_target
    expected = hf_generate(target, engine_prompts, 20, eos_token_id=eos)
    assert any(e[-1] == eos and len(e) < 20 for e in expected)
    assert reference(target, engine_prompts, 20) == expected
    _, outs = generate(target, engine_prompts, greedy(20), draft_spec(twin_draft, 3))
    assert token_ids(outs) == expected


NEW_FAMILIES = {  # the families the engine runs beside the Llama family's own options
    # q/k/v and gate/up fused in the checkpoint (split at load); a window on every layer,
    # shorter than the outputs
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**FAMILY, sliding_window=6)),
    # sparse experts in place of the MLP, 2 of 4 per token, on every layer
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **FAMILY, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
}
FAMILY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=None,
              bos_token_id=None)


@pytest.mark.parametrize("family", list(NEW_FAMILIES))
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_new_families_match_transformers_generate(tmp_path, engine_prompts, family, method):
    """Phi-3 and Qwen3-MoE targets served speculatively, greedy-identical to transformers."""
    torch.manual_seed(0)
    model = NEW_FAMILIES[family]()
    with torch.no_grad():  # outputs that move (the default init decodes one token forever)
        for p in model.parameters():
            p.normal_(0, 0.3) if p.ndim > 1 else None
    model.save_pretrained(tmp_path)
    expected = hf_generate(str(tmp_path), engine_prompts, 16)
    assert len({tuple(e) for e in expected}) == len(expected)  # each prompt its own output
    spec = {"method": method, "num_speculative_tokens": 3}
    _, outs = generate(str(tmp_path), engine_prompts, greedy(16), spec)
    assert token_ids(outs) == expected


# ---- stop conditions and their metrics --------------------------------------------------------

@pytest.mark.parametrize("k", [3, 5])
def test_eos_inside_accepted_prefix(eos_target, twin_draft, engine_prompts, k):
    """With a draft identical to the target, EOS arrives as an accepted draft: the output ends at
    it with finish_reason "stop", and the drafts after it are not counted as accepted."""
    target, eos = eos_target
    full = reference(target, engine_prompts, 20, ignore_eos=True)
    assert all(len(f) == 20 for f in full)  # ignore_eos: EOS does not stop
    llm, outs = generate(target, engine_prompts, greedy(20), draft_spec(twin_draft, k))
    assert token_ids(outs) == reference(target, engine_prompts, 20)
    cut_inside = 0
    for out, seq in zip(outs, full):
        if eos in seq:
            assert out.token_ids == seq[: seq.index(eos) + 1]
            assert out.finish_reason == "stop"
        else:
            assert out.token_ids == seq and out.finish_reason == "length"
        assert out.metrics == twin_metrics(seq, k, 20, stop={eos}).as_dict()
        cut_inside += out.metrics["num_accepted_tokens"] < out.metrics["num_draft_tokens"]
    assert cut_inside, "no EOS landed inside an accepted prefix; pick other prompts"
    check_engine_metrics(llm, outs, k)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 7])
def test_max_tokens_inside_accepted_prefix(tiny_target, twin_draft, engine_prompts, max_tokens):
    """k = 5 drafts would overshoot max_tokens: the engine emits exactly max_tokens tokens and
    the twin draft's acceptance stays 1.0 (drafts are clipped, not cut after acceptance)."""
    k = 5
    full = reference(tiny_target, engine_prompts, MAX_TOKENS)
    llm, outs = generate(tiny_target, engine_prompts, greedy(max_tokens), draft_spec(twin_draft, k))
    for out, seq in zip(outs, full):
        assert out.token_ids == seq[:max_tokens]
        assert out.finish_reason == "length"
        assert out.metrics == twin_metrics(seq, k, max_tokens).as_dict()
    m = check_engine_metrics(llm, outs, k)
    assert m["acceptance_rate"] == (1.0 if max_tokens > 2 else 0.0)


@pytest.mark.parametrize("proposer", ["twin", "pard", "ngram"])
def test_max_model_len_cuts(case, tiny_target, engine_prompts, proposer):
    """max_model_len bounds prompt + output; a prompt of max_model_len - 1 gets one token."""
    k = 3
    _, _, _, spec = case(proposer, k)
    max_model_len = 14
    prompts = engine_prompts + [list(range(20, 33))]  # the last: 13 tokens
    llm, outs = generate(tiny_target, prompts, greedy(MAX_TOKENS), spec,
                         max_model_len=max_model_len)
    full = reference(tiny_target, prompts, MAX_TOKENS)
    for p, out, seq in zip(prompts, outs, full):
        n = min(MAX_TOKENS, max_model_len - len(p))
        assert out.token_ids == seq[:n] and out.finish_reason == "length"
        if proposer == "twin":
            assert out.metrics == twin_metrics(seq, k, MAX_TOKENS, prompt_len=len(p),
                                               max_model_len=max_model_len).as_dict()
    assert len(outs[-1].token_ids) == 1
    check_engine_metrics(llm, outs, k)


def test_min_tokens(eos_target, twin_draft, tiny_draft, pard_draft, engine_prompts):
    """EOS is suppressed before min_tokens for that request only; speculative == plain == HF."""
    target, eos = eos_target
    full = reference(target, engine_prompts, 20, ignore_eos=True)
    i, first = min(((i, s.index(eos)) for i, s in enumerate(full) if eos in s),
                   key=lambda pair: pair[1])
    min_tokens = first + 2
    params = [greedy(20, min_tokens=min_tokens if j == i else 0)
              for j in range(len(engine_prompts))]
    _, outs = generate(target, engine_prompts, params)
    plain = token_ids(outs)
    assert plain[i][:first] == full[i][:first]
    assert eos not in plain[i][:min_tokens] and len(plain[i]) > min_tokens
    for j, out in enumerate(plain):  # the other requests stop at their first EOS as before
        if j != i:
            assert out == reference(target, engine_prompts, 20)[j]
    assert plain[i] == hf_generate(target, [engine_prompts[i]], 20, eos_token_id=eos,
                                   min_new_tokens=min_tokens)[0]
    for spec in (draft_spec(twin_draft, 3), draft_spec(tiny_draft, 3),
                 draft_spec(pard_draft, 3, parallel_drafting=True)):
        llm, outs = generate(target, engine_prompts, params, spec)
        assert token_ids(outs) == plain, spec
        check_engine_metrics(llm, outs, 3)


def test_stop_token_ids(tiny_target, twin_draft, tiny_draft, engine_prompts):
    full = reference(tiny_target, engine_prompts, MAX_TOKENS)
    stop = full[1][4]
    expected = [s[: s.index(stop) + 1] if stop in s else s for s in full]
    reasons = ["stop" if stop in s else "length" for s in full]
    for spec in (None, draft_spec(twin_draft, 3), draft_spec(tiny_draft, 5)):
        llm, outs = generate(tiny_target, engine_prompts, greedy(stop_token_ids=[stop]), spec)
        assert token_ids(outs) == expected
        assert [o.finish_reason for o in outs] == reasons
        if spec:
            check_engine_metrics(llm, outs, spec["num_speculative_tokens"])


def test_stop_token_ids_respect_min_tokens(tiny_target, twin_draft, engine_prompts):
    """vLLM: neither EOS nor stop_token_ids may end a request before min_tokens."""
    prompt = engine_prompts[1]
    full = reference(tiny_target, [prompt], MAX_TOKENS)[0]
    stop, min_tokens = full[2], 6
    expected = hf_generate(tiny_target, [prompt], MAX_TOKENS, eos_token_id=stop,
                           min_new_tokens=min_tokens)[0]
    for spec in (None, draft_spec(twin_draft, 3)):
        _, outs = generate(tiny_target, [prompt],
                           greedy(stop_token_ids=[stop], min_tokens=min_tokens), spec)
        assert outs[0].token_ids == expected
        assert stop not in outs[0].token_ids[:min_tokens]


def test_metrics_accumulate_over_generate_calls(tiny_target, twin_draft, engine_prompts):
    llm = LLM(tiny_target, speculative_config=draft_spec(twin_draft, 3), dtype="float32")
    first = llm.generate(engine_prompts, greedy())
    after_one = llm.get_metrics()
    second = llm.generate(engine_prompts[:2], greedy(6))
    total = SpecMetrics()
    for out in first + second:
        m = out.metrics
        total.merge(SpecMetrics(m["num_drafts"], m["num_draft_tokens"],
                                m["num_accepted_tokens"], list(m["num_accepted_tokens_per_pos"])))
    assert llm.get_metrics() == total.as_dict()
    assert llm.get_metrics()["num_drafts"] > after_one["num_drafts"]
    assert llm.get_metrics()["acceptance_rate"] == 1.0


@pytest.mark.parametrize("parallel", [False, True])
def test_draft_max_model_len_stops_drafting(tiny_target, twin_draft, pard_draft, engine_prompts,
                                            parallel):
    """A sequence that outgrows the draft's max_model_len decodes on without drafts (as vLLM);
    it used to overflow the draft's KV cache."""
    draft = pard_draft if parallel else twin_draft
    limited = draft_spec(draft, 3, parallel_drafting=parallel, max_model_len=10)
    llm, outs = generate(tiny_target, engine_prompts, greedy(), limited, max_model_len=64)
    assert token_ids(outs) == reference(tiny_target, engine_prompts, MAX_TOKENS)
    m = check_engine_metrics(llm, outs, 3)
    free, _ = generate(tiny_target, engine_prompts, greedy(),
                       draft_spec(draft, 3, parallel_drafting=parallel), max_model_len=64)
    assert 0 < m["num_draft_tokens"] < free.get_metrics()["num_draft_tokens"]
    # the 7-token prompt: a step drafts only while len(tokens) + k - 1 <= 10
    assert outs[1].metrics["num_drafts"] == 1


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_greedy_rows_in_a_sampled_batch(tiny_target, tiny_draft, engine_prompts, method):
    """Per-request sampling settings: greedy rows stay greedy beside sampled rows (and top-k /
    top-p on greedy rows change nothing)."""
    spec = draft_spec(tiny_draft, 3, rejection_sample_method=method)
    params = [greedy(), SamplingParams(temperature=1.0, top_k=5, max_tokens=MAX_TOKENS),
              greedy(top_p=0.5, top_k=3), SamplingParams(temperature=0.7, top_p=0.8,
                                                         max_tokens=MAX_TOKENS)]
    llm, outs = generate(tiny_target, engine_prompts, params, spec)
    ref = reference(tiny_target, engine_prompts, MAX_TOKENS)
    assert outs[0].token_ids == ref[0] and outs[2].token_ids == ref[2]
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    check_engine_metrics(llm, outs, 3)


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_synthetic_acceptance(tiny_target, tiny_draft, engine_prompts, rate):
    """synthetic: acceptance follows the configured rate, whatever the drafts (not lossless)."""
    spec = draft_spec(tiny_draft, 3, rejection_sample_method="synthetic",
                      synthetic_acceptance_rate=rate)
    llm, outs = generate(tiny_target, engine_prompts, greedy(), spec)
    m = check_engine_metrics(llm, outs, 3)
    assert m["num_draft_tokens"] > 0 and m["acceptance_rate"] == rate
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)


def test_with_config_forks_the_loaded_target(tiny_target):
    """A fork shares the target's weights but has its own cache, proposer, metrics and batch size;
    its output equals a freshly loaded engine's with the same settings."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    base = LLM(tiny_target, max_num_seqs=1, device="cpu")
    fork = base.with_config(spec, max_num_seqs=4)
    assert fork.target is base.target and fork.cache is not base.cache
    assert fork.cache.max_batch == 4 and base.cache.max_batch == 1 and base.proposer is None
    fresh = LLM(tiny_target, speculative_config=spec, max_num_seqs=4, device="cpu")
    assert ([o.token_ids for o in fork.generate(LOOPY_PROMPTS, params)]
            == [o.token_ids for o in fresh.generate(LOOPY_PROMPTS, params)])
    assert fork.get_metrics() == fresh.get_metrics() and fork.get_metrics()["num_drafts"] > 0
    assert base.get_metrics()["num_drafts"] == 0
    with pytest.raises(ValueError, match="'max_num_seqs'"):
        base.with_config(None, max_num_seqs=0)


def test_with_config_keeps_the_seed_and_not_the_timers(tiny_target):
    from infer.timing import EngineTimers

    sampled = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    base = LLM(tiny_target, max_num_seqs=1, device="cpu", seed=3)
    want = LLM(tiny_target, max_num_seqs=4, device="cpu", seed=3).generate(LOOPY_PROMPTS, sampled)
    base.timers = EngineTimers.on(base.device)  # timing the parent must not time a fork
    fork = base.with_config(None, max_num_seqs=4)
    assert fork.timers is None
    got = fork.generate(LOOPY_PROMPTS, sampled)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]  # seed 3 inherited
    other = base.with_config(None, max_num_seqs=4, seed=4).generate(LOOPY_PROMPTS, sampled)
    assert [o.token_ids for o in other] != [o.token_ids for o in want]
