"""Many clients at once: continuous batching with no request mixed up, a bad request that
hurts nobody, a disconnected client whose slot is freed, a server that answers /health while
it generates, and /metrics counters equal to the engine's."""

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infer.engine import LLM
from infer.sampling import SamplingParams

from .conftest import NGRAM, PROMPTS


def _params(i: int) -> dict:
    """Even requests greedy, odd ones sampled with their own seed (batch-invariant)."""
    if i % 2 == 0:
        return dict(temperature=0.0, max_tokens=16 + i % 5)
    return dict(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=16 + i % 5)


async def _stream_all(url: str, n: int) -> tuple[list[str], int]:
    """``n`` concurrent streamed completions plus one malformed request among them."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> str:
        stream = await client.completions.create(model="tiny", prompt=PROMPTS[i % 8],
                                                 stream=True, **_params(i))
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def bad() -> int:
        await asyncio.sleep(0.05)  # while the others run
        async with httpx.AsyncClient() as http:
            r = await http.post(url + "/v1/completions", json={"prompt": "x", "top_k": -7})
        return r.status_code

    *texts, status = await asyncio.gather(*[one(i) for i in range(n)], bad())
    await client.close()
    return texts, status


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["autoregressive", "ngram"])
def test_32_concurrent_streams(chat_target, serve, spec):
    server = serve(LLM(chat_target, spec, max_num_seqs=8))
    texts, status = asyncio.run(_stream_all(server.url, 32))
    assert status == 400
    offline = LLM(chat_target, spec, max_num_seqs=8)
    expected = [offline.generate(PROMPTS[i % 8], SamplingParams(**_params(i)))[0].text
                for i in range(32)]
    assert texts == expected  # greedy and seeded: each equals its request alone, offline
    assert len(set(texts)) > 8


def _metrics(url: str) -> dict[str, float]:
    """``name{label=value,...}`` -> value, parsed by prometheus_client's own parser."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k not in ("model_name", "engine"))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_metrics_equal_get_metrics_and_offline(chat_target, serve):
    llm = LLM(chat_target, NGRAM, max_num_seqs=4)
    server = serve(llm, name="tiny")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    params = dict(temperature=0, max_tokens=20, ignore_eos=True)
    for prompt in PROMPTS:
        client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=20,
                                  extra_body={"ignore_eos": True})  # vLLM's extra field
    m, engine = _metrics(server.url), llm.get_metrics()
    offline = LLM(chat_target, NGRAM)
    offline.generate(PROMPTS, SamplingParams(**params))
    assert engine == offline.get_metrics()  # the same work counts the same
    assert m["vllm:spec_decode_num_drafts_total{}"] == engine["num_drafts"] > 0
    assert m["vllm:spec_decode_num_draft_tokens_total{}"] == engine["num_draft_tokens"]
    assert m["vllm:spec_decode_num_accepted_tokens_total{}"] == engine["num_accepted_tokens"] > 0
    for pos in range(3):
        assert (m[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={pos}}}"]
                == engine["num_accepted_tokens_per_pos"][pos])
    tok = llm.tokenizer
    assert m["vllm:prompt_tokens_total{}"] == sum(len(tok(p)["input_ids"]) for p in PROMPTS)
    assert m["vllm:generation_tokens_total{}"] == 20 * len(PROMPTS)
    assert m["vllm:request_success_total{finished_reason=length}"] == len(PROMPTS)
    assert m["vllm:time_to_first_token_seconds_count{}"] == len(PROMPTS)
    assert m["vllm:e2e_request_latency_seconds_count{}"] == len(PROMPTS)
    # one inter-token observation per decode step of each request (the first token comes
    # from the prefill): a step emits its accepted drafts plus one token
    steps = 19 * len(PROMPTS) - engine["num_accepted_tokens"]
    assert m["vllm:inter_token_latency_seconds_count{}"] == steps
    assert m["vllm:num_requests_running{}"] == 0 == m["vllm:num_requests_waiting{}"]


def test_no_spec_series_without_speculation(chat_target, serve):
    server = serve(LLM(chat_target, None, max_num_seqs=2))
    m = _metrics(server.url)
    assert not any(k.startswith("vllm:spec_decode") for k in m)
    assert "vllm:generation_tokens_total{}" in m


def _wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(scope="module")
def long_target(chat_target, make_tiny_llama):
    """``chat_target``'s tokenizer on a wider model with an 8k context: requests that run for
    seconds (4000 tokens) without a slow test."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_target)
    path = make_tiny_llama("long_target", vocab=len(tok), hidden=128, layers=4,
                           extra_config={"max_position_embeddings": 8192})
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("streamed", [True, False])
def test_disconnect_frees_the_slot(long_target, serve, streamed):
    """A long request (one slot) is dropped by its client: it is aborted, its slot is free
    for the next request, and /health answered while it ran."""
    llm = LLM(long_target, NGRAM, max_num_seqs=1)
    server = serve(llm)
    long = {"prompt": PROMPTS[0], "max_tokens": 4000, "ignore_eos": True, "stream": streamed}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        if streamed:
            with http.stream("POST", "/v1/completions", json=long) as r:
                lines = r.iter_lines()  # kept: a collected line iterator closes the connection
                next(lines)  # it runs
                assert http.get("/health").status_code == 200
                assert llm.num_running == 1
                lines.close()  # the client goes away
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=long, timeout=1.0)  # gives up, disconnects
        assert _wait_for(lambda: _metrics(server.url).get(
            "vllm:request_success_total{finished_reason=abort}") == 1)
        assert _wait_for(lambda: llm.num_running == 0)
        r = http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 8})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0


def test_an_engine_failure_fails_requests_not_the_server(chat_target, serve):
    """A bug inside a step: the requests in flight get a 500 (an error event when streamed),
    /health turns 503 and later requests a 503; the HTTP server itself keeps answering."""
    llm = LLM(chat_target, None, max_num_seqs=2)

    def broken():
        raise RuntimeError("boom")

    llm.decode = broken
    server = serve(llm)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8})
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={"prompt": PROMPTS[0], "stream": True})
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        assert "vllm:num_requests_running" in http.get("/metrics").text
