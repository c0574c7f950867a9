"""The draft-model proposer's catch-up: a new prompt is fed as a group of its own, not padding
the batch."""

from infer.engine import LLM
from infer.sampling import SamplingParams


def test_a_prompt_backlog_is_fed_as_its_own_group_not_padding_the_batch(tiny_target,
                                                                          twin_draft):
    """Three requests on two slots: the third (a long prompt) is admitted while the first still
    decodes. Its prompt goes through the draft model as a group of its own row, unpadded, in the
    catch-up's forward (``forward_groups``), so no group of several rows is wider than the k + 1
    tokens a verify step leaves; greedy output is the target's."""
    k = 3
    prompts = [[5, 6, 7], [8, 9], list(range(10, 50))]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (16, 4, 8)]
    spec = {"method": "draft_model", "model": twin_draft, "num_speculative_tokens": k}
    llm = LLM(tiny_target, speculative_config=spec, max_num_seqs=2)
    shapes, grouped, model = [], [], llm.proposer.model
    forward, forward_groups = model.forward, model.forward_groups

    def record(ids, *args, **kwargs):
        shapes.append(tuple(ids.shape))
        return forward(ids, *args, **kwargs)

    def record_groups(groups, *args, **kwargs):
        if len(groups) > 1:  # one group is the plain forward (recorded there)
            grouped.append([tuple(g.input_ids.shape) for g in groups])
        return forward_groups(groups, *args, **kwargs)
    model.forward, model.forward_groups = record, record_groups
    got = llm.generate(prompts, params)
    want = LLM(tiny_target, max_num_seqs=2).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # the long prompt (all its tokens but the newest) before the batch's catch-up rows
    assert len(grouped) == 1 and grouped[0][0] == (1, 40) and grouped[0][1][1] <= k + 1
    assert all(t <= k + 1 for b, t in shapes if b > 1), shapes
