"""A tiny chat model with a real tokenizer, and servers on free local ports (no network: the
servers listen on 127.0.0.1 and the real ``openai`` client talks to them)."""

import pytest

from infer.engine import LLM
from infer.serve.server import start_server
from train.tiny.corpus import train_tokenizer

CODE = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 2}
PROMPTS = ["def add(a, b):\n", "for i in range(", "class Point:\n    def", "x = 1\ny =",
           "import os\n", "while True:\n    ", "return [", "if a > b:\n"]


@pytest.fixture(scope="session")
def chat_target(tmp_path_factory, make_tiny_llama):
    """A loopy tiny Llama (drafts get accepted) with draftsmith's BPE tokenizer and chat
    template; EOS is the tokenizer's."""
    tok = train_tokenizer(CODE * 4, vocab_size=300)
    path = make_tiny_llama("chat_target", vocab=len(tok), hidden=32, std=0.1, seed=5,
                           eos=tok.eos_token_id)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def serve():
    """``serve(llm, name="tiny")`` -> a started server; all are closed after the module."""
    servers = []

    def start(llm: LLM, name: str = "tiny"):
        servers.append(start_server(llm, port=0, model_name=name))
        return servers[-1]

    yield start
    for s in servers:
        s.close()
