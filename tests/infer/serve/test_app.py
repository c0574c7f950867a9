"""The OpenAI-compatible routes, spoken to by the real ``openai`` client: answers equal the
offline engine's, streams equal non-streamed answers, bad requests are 400s naming the field
and never reach the engine."""

import json

import httpx
import openai
import pytest

from infer.engine import LLM
from infer.sampling import SamplingParams

from .conftest import NGRAM, PROMPTS


@pytest.fixture(scope="module")
def server(chat_target, serve):
    return serve(LLM(chat_target, NGRAM, max_num_seqs=4))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(chat_target):
    return LLM(chat_target, NGRAM)


def test_completions_equal_generate(client, offline):
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = offline.generate(PROMPTS[:4], params)
    for prompt, exp in zip(PROMPTS[:4], expected):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        choice = r.choices[0]
        assert (choice.text, choice.finish_reason) == (exp.text, exp.finish_reason)
        assert r.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert r.usage.completion_tokens == len(exp.token_ids)
        assert r.object == "text_completion" and r.model == "tiny"
    batch = client.completions.create(model="tiny", prompt=PROMPTS[:4], max_tokens=24,
                                      temperature=0)  # several prompts: one choice each
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [
        e.text for e in expected]
    ids = offline.tokenizer(PROMPTS[0])["input_ids"]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == expected[0].text


def test_chat_equals_generate_on_the_template(client, offline):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "for i in range("}]
    tok = offline.tokenizer
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    exp = offline.generate([ids], SamplingParams(temperature=0, max_tokens=20))[0]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20,
                                       temperature=0)
    assert r.choices[0].message.content == exp.text
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(ids)
    parts = [{"type": "text", "text": "for i in range("}]
    r2 = client.chat.completions.create(model="tiny", messages=messages[:1] + [
        {"role": "user", "content": parts}], max_tokens=20, temperature=0)
    assert r2.choices[0].message.content == exp.text  # text parts read as the plain string


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_equals_non_streaming(client, chat):
    kwargs = dict(model="tiny", max_tokens=30, temperature=0.8, seed=11, stop=["(", "\n\n"])
    if chat:
        kwargs["messages"] = [{"role": "user", "content": PROMPTS[1]}]
        whole = client.chat.completions.create(**kwargs)
        chunks = list(client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        expected = whole.choices[0].message.content
    else:
        kwargs["prompt"] = PROMPTS[1]
        whole = client.completions.create(**kwargs)
        chunks = list(client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        expected = whole.choices[0].text
    assert text == expected and len(chunks) > 3
    last = [c for c in chunks if c.choices][-1].choices[0]
    assert last.finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_stream_ends_with_done(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 5, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


BAD = [  # (body, status, param)
    ({"prompt": "x", "temprature": 0.5}, 400, "temprature"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 2, 10 ** 6]}, 400, "prompt"),
    ({"prompt": "x " * 600}, 400, "prompt"),  # longer than max_model_len (256)
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "x", "stream_options": {"include_usge": True}}, 400, "stream_options.include_usge"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({}, 400, "prompt"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_completion_requests(server, body, status, param):
    before = server.served.llm.get_metrics()["num_drafts"], _admitted(server)
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == status and err["message"]
    assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert (server.served.llm.get_metrics()["num_drafts"], _admitted(server)) == before


def _admitted(server) -> float:
    """Prompt tokens the server has processed (vllm:prompt_tokens): a refused request adds 0."""
    return server.served.loop.metrics.prompt_tokens._value.get()


def test_bad_chat_requests_and_malformed_json(server):
    cases = [({"messages": []}, "messages"),
             ({"messages": [{"role": 1, "content": "x"}]}, "messages.0.role"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
              "messages.0.content"),
             ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
              "tools"),
             ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3},
              "max_tokens")]
    for body, param in cases:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x",',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


def test_models_and_health(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].max_model_len == 256
    assert httpx.get(server.url + "/health").status_code == 200
