"""Per-request speculative-decoding stats (``serve.per_request_spec_decode_metrics``): each
response says how its drafts fared, and summed over requests the stats equal /metrics."""

import json

import httpx
import openai
import pytest

from infer.engine import LLM
from infer.metrics import SpecMetrics
from infer.serve.server import start_server
from infer.serve.spec_stats import request_spec_stats

from .conftest import NGRAM, PROMPTS
from .test_concurrency import _metrics


def test_stats_of_one_request_follow_from_its_counters():
    m = SpecMetrics()
    for drafted, accepted in [(3, 3), (3, 0), (3, 1), (2, 2), (3, 1)]:
        m.record(drafted, accepted)
    steps = [(3, 3), (3, 0), (3, 1), (2, 2), (3, 1)]
    s = request_spec_stats(m, 3, steps)
    assert s["acceptance_histogram"] == [1, 2, 1, 1]  # exactly 0, 1, 2, 3 accepted
    assert (s["num_spec_steps"], s["num_accepted_draft_tokens"], s["num_draft_tokens"]) == \
        (5, 7, 14)
    assert s["mean_acceptance_length"] == 1 + 7 / 5 and s["draft_acceptance_rate"] == 7 / 14
    assert s["per_step_accepted"] == [3, 0, 1, 2, 1] and s["per_step_drafted"] == [3, 3, 3, 2, 3]
    assert s["num_spec_tokens"] == 3 and "per_step_drafted" not in request_spec_stats(m, 3, None)


@pytest.fixture
def detailed(chat_target):
    llm = LLM(chat_target, NGRAM, max_num_seqs=4)
    server = start_server(llm, port=0, model_name="tiny", spec_stats="detailed")
    yield server
    server.close()


def _streamed_stats(url: str, prompt: str) -> dict:
    """A streamed completion's final usage chunk's stats (raw SSE: the openai client drops
    fields it does not know)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    last = events[-1]
    assert last["choices"] == [] and "usage" in last
    return last["metrics"]["speculative_decoding"]


def test_summed_over_requests_the_stats_equal_the_prometheus_counters(detailed):
    url = detailed.url
    stats = []
    for prompt in PROMPTS[:4]:  # plain completions
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                      "max_tokens": 20, "temperature": 0},
                       timeout=60).json()
        stats.append(r["metrics"]["speculative_decoding"])
    chat = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    answer = chat.chat.completions.create(model="tiny", max_tokens=20, temperature=0,
                                          messages=[{"role": "user", "content": PROMPTS[4]}])
    stats.append(answer.model_extra["metrics"]["speculative_decoding"])
    stats += [_streamed_stats(url, p) for p in PROMPTS[5:7]]
    m = _metrics(url)
    assert sum(s["num_spec_steps"] for s in stats) == m["vllm:spec_decode_num_drafts_total{}"] > 0
    assert sum(s["num_draft_tokens"] for s in stats) == \
        m["vllm:spec_decode_num_draft_tokens_total{}"]
    assert sum(s["num_accepted_draft_tokens"] for s in stats) == \
        m["vllm:spec_decode_num_accepted_tokens_total{}"] > 0
    for s in stats:
        hist = s["acceptance_histogram"]
        assert len(hist) == 4 and sum(hist) == s["num_spec_steps"] == len(s["per_step_drafted"])
        assert sum(j * n for j, n in enumerate(hist)) == s["num_accepted_draft_tokens"] == \
            sum(s["per_step_accepted"])
        assert s["mean_acceptance_length"] == pytest.approx(
            1 + s["num_accepted_draft_tokens"] / s["num_spec_steps"])


def test_summary_has_no_step_lists_and_none_has_no_metrics(chat_target):
    for level, want in [("summary", True), ("none", False)]:
        server = start_server(LLM(chat_target, NGRAM), port=0, model_name="tiny",
                              spec_stats=level)
        try:
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8}).json()
        finally:
            server.close()
        assert ("metrics" in r) is want
        if want:
            assert "per_step_accepted" not in r["metrics"]["speculative_decoding"]


def test_null_without_speculation_or_with_several_choices(chat_target):
    server = start_server(LLM(chat_target), port=0, model_name="tiny", spec_stats="summary")
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8}).json()
    finally:
        server.close()
    assert r["metrics"] == {"speculative_decoding": None}
    server = start_server(LLM(chat_target, NGRAM), port=0, model_name="tiny",
                          spec_stats="summary")
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPTS[:2], "max_tokens": 8}).json()
    finally:
        server.close()
    assert len(r["choices"]) == 2 and r["metrics"] == {"speculative_decoding": None}
