"""Output text: stop strings (vLLM's rules) in the engine, and streamed deltas that add up to
the final text."""

import pytest

from infer.detokenize import IncrementalText, StopStrings, cut_at_stop, output_text
from infer.engine import LLM
from infer.foundation.errors import ConfigError
from infer.sampling import SamplingParams
from train.tiny.corpus import train_tokenizer

CODE = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
        "naïve café → ünïcode ✓ 東京\n"]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CODE * 8, vocab_size=300)


@pytest.fixture(scope="module")
def text_target(tokenizer, make_tiny_llama, tmp_path_factory):
    """A loopy tiny Llama with a real byte-level BPE tokenizer (no EOS: runs to max_tokens)."""
    path = make_tiny_llama("text_target", vocab=len(tokenizer), hidden=32, std=0.1, seed=3)
    tokenizer.save_pretrained(path)
    return path


def test_stop_string_window_and_cut(tokenizer):
    ids = tokenizer("for i in range(10):\n    print(i)\n")["input_ids"]
    stops = StopStrings(tokenizer, ["print", "zzz"])
    first = next(n for n in range(1, len(ids) + 1) if stops.hit(ids[:n]))
    assert "print" in tokenizer.decode(ids[:first])
    assert "print" not in tokenizer.decode(ids[:first - 1])
    assert stops.hit(ids[:first]) == "print"
    assert cut_at_stop("a = 1  # print me", "print") == "a = 1  # "
    assert cut_at_stop("no stop here", None) == "no stop here"
    assert output_text(tokenizer, ids, "print") == "for i in range(10):\n    "
    assert output_text(tokenizer, ids, 7) == tokenizer.decode(ids)  # a stop token id: no cut


@pytest.mark.parametrize("stops", [[], ["print"], ["10):\n"]])
def test_incremental_deltas_add_up(tokenizer, stops):
    """Deltas after every token (multi-byte characters split across tokens included) add up
    to the final text, and no delta ever holds the start of a stop string cut later."""
    ids = tokenizer(CODE[2] + CODE[1])["input_ids"]
    stop_reason = None
    if stops:
        checker = StopStrings(tokenizer, stops)
        end = next(n for n in range(1, len(ids) + 1) if checker.hit(ids[:n]))
        ids, stop_reason = ids[:end], checker.hit(ids[:end])
    inc = IncrementalText(tokenizer, stops)
    pieces = [inc.delta(ids[:n]) for n in range(1, len(ids))]
    pieces.append(inc.delta(ids, stop_reason, final=True))
    final = output_text(tokenizer, ids, stop_reason)
    assert "".join(pieces) == final
    assert all("\ufffd" not in p for p in pieces)
    if stops:
        assert stops[0] not in "".join(pieces[:-1]) and final.endswith(("    ", "range("))


def test_engine_stop_strings(text_target, tokenizer):
    """The request ends at the token completing the stop string: its text is cut before the
    string, its tokens keep that token, stop_reason is the string; with and without
    speculation (tokens after the stop inside an accepted draft are dropped)."""
    prompt = "for i in range(10):\n"
    free = LLM(text_target).generate(prompt, SamplingParams(temperature=0, max_tokens=40))[0]
    text = free.text
    assert len(text) > 8, "the loopy target should produce some text"
    stop = text[4:7]
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop, "never-there"])
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3,
                        "prompt_lookup_min": 1, "prompt_lookup_max": 2}):
        out = LLM(text_target, spec).generate(prompt, params)[0]
        assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
        assert out.text == text[:text.find(stop)]
        n = len(out.token_ids)
        assert out.token_ids == free.token_ids[:n]
        assert stop in tokenizer.decode(out.token_ids)
        assert stop not in tokenizer.decode(out.token_ids[:-1])


def test_engine_stop_strings_wait_for_min_tokens(text_target):
    prompt = "def add(a, b):\n"
    free = LLM(text_target).generate(prompt, SamplingParams(temperature=0, max_tokens=30))[0]
    stop = free.text[:2]  # completed by the first token or two
    out = LLM(text_target).generate(prompt, SamplingParams(temperature=0, max_tokens=30,
                                                           stop=stop, min_tokens=6))[0]
    assert len(out.token_ids) > 6  # not before min_tokens were generated
    assert out.finish_reason in ("stop", "length")


def test_stop_token_id_is_the_stop_reason(text_target):
    llm = LLM(text_target)
    free = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=12))[0]
    tok = free.token_ids[3]
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=12,
                                                 stop_token_ids=[tok]))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == tok
    assert out.token_ids[-1] == tok


def test_stop_strings_need_a_tokenizer_and_strings(tiny_target):
    out = LLM(tiny_target).generate([1, 2, 3], SamplingParams(max_tokens=4, stop=["x"]))[0]
    assert out.finish_reason == "error" and "stop strings" in out.error
    assert SamplingParams(stop="ab").stop == ["ab"]
    for bad in ([""], [3], 5):
        with pytest.raises(ConfigError, match="'stop'") as err:
            SamplingParams(stop=bad)
        assert err.value.key == "stop"
