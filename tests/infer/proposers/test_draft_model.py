"""The draft-model proposer's catch-up: a new prompt is fed on its own, not padding the batch."""

from infer.engine import LLM
from infer.sampling import SamplingParams


def test_a_prompt_backlog_is_fed_alone_not_padding_the_batch(tiny_target, twin_draft):
    """Three requests on two slots: the third (a long prompt) is admitted while the first still
    decodes. Its prompt goes through the draft model in a forward of its own row, so no forward
    over several rows is wider than the k + 1 tokens a verify step leaves; greedy output is the
    target's."""
    k = 3
    prompts = [[5, 6, 7], [8, 9], list(range(10, 50))]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (16, 4, 8)]
    spec = {"method": "draft_model", "model": twin_draft, "num_speculative_tokens": k}
    llm = LLM(tiny_target, speculative_config=spec, max_num_seqs=2)
    shapes, forward = [], llm.proposer.model.forward

    def record(ids, *args, **kwargs):
        shapes.append(tuple(ids.shape))
        return forward(ids, *args, **kwargs)
    llm.proposer.model.forward = record
    got = llm.generate(prompts, params)
    want = LLM(tiny_target, max_num_seqs=2).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert (1, 40) in shapes  # the long prompt, alone (all its tokens but the newest)
    assert all(t <= k + 1 for b, t in shapes if b > 1), shapes
