"""Generation through transformers' ``generate`` (infer/eval/transformers_session.py): what the
regenerator reads of an engine, for targets draftsmith's engine does not run."""

from __future__ import annotations

from infer.engine import LLM
from infer.eval.transformers_session import TransformersSession
from infer.sampling_params import SamplingParams

from ..conftest import save_tiny_llama

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]


def test_greedy_answers_equal_the_engines(tmp_path):
    """Batched with left padding, the greedy answers are the engine's, stop token and all."""
    target = save_tiny_llama(tmp_path / "t", eos=5, std=0.3)
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[17])
    session = TransformersSession(target, max_num_seqs=2, max_model_len=64)
    got = session.generate(PROMPTS, params)
    want = LLM(target, max_num_seqs=2, max_model_len=64).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason
                                                         for o in want]
    assert 5 in session.eos_ids


def test_sampling_follows_the_generator_and_long_prompts_are_refused(tmp_path):
    target = save_tiny_llama(tmp_path / "t", std=0.3)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8)
    session = TransformersSession(target, max_num_seqs=3, max_model_len=8)
    runs = []
    for _ in range(2):
        session.generator.manual_seed(11)  # as the regenerator re-seeds each chunk
        runs.append([o.outputs[0].token_ids for o in session.generate(PROMPTS, params)])
    assert runs[0] == runs[1]
    session.generator.manual_seed(12)
    assert [o.outputs[0].token_ids for o in session.generate(PROMPTS, params)] != runs[0]
    out = session.generate(PROMPTS, params)
    assert out[2].error == "prompt 2: longer than max_model_len 8"
    assert out[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 3  # 8 - 5
