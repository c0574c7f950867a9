"""Bad input to the engine gives clear errors (what was wrong, the value, what is allowed)."""

import re
import shutil

import pytest
import torch

from infer.engine import LLM
from infer.proposers.base import PROPOSERS
from infer.sampling import SamplingParams
from infer.spec_config import METHODS

pytestmark = pytest.mark.usefixtures("single_thread")


def greedy(max_tokens=8, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def served_methods():
    return PROPOSERS.names()


def refused(out, *fragments):
    """``out`` was refused alone: no tokens, finish_reason "error", every fragment in error."""
    assert out.finish_reason == "error" and out.token_ids == [] and out.text == ""
    for fragment in fragments:
        assert fragment in out.error, (fragment, out.error)
    return True


def test_empty_prompt(tiny_target):
    llm = LLM(tiny_target, dtype="float32")
    good, empty = llm.generate([[1, 2], []], greedy())
    assert refused(empty, "prompt 1: is empty; expected at least one token")
    assert empty.prompt_token_ids == [] and empty.request_id == 1
    assert good.error is None and len(good.token_ids) == 8
    assert refused(llm.generate({"prompt_token_ids": []}, greedy())[0], "prompt 0: is empty")
    with pytest.raises(ValueError, match="no prompts given"):
        llm.generate([], greedy())
    assert len(llm.generate([[1, 2]], greedy())[0].token_ids) == 8  # still usable


def test_bad_token_ids(tiny_target):
    llm = LLM(tiny_target, dtype="float32")
    outs = llm.generate([[1, 96], [-1, 2], [3, 4], [1, 2.5, True], {"tokens": [1, 2]}, None],
                        greedy())
    assert refused(outs[0], "prompt 0: has token ids outside [0, 96): [96]",
                   "expected integers in [0, 96)")
    assert outs[0].prompt_token_ids == [1, 96]  # echoed back as given
    assert refused(outs[1], "prompt 1: has token ids outside [0, 96): [-1]")
    assert outs[2].error is None and len(outs[2].token_ids) == 8
    assert refused(outs[3], "prompt 3: has token ids outside [0, 96): [2.5, True]")
    assert outs[3].prompt_token_ids == []  # not ids: not echoed
    assert refused(outs[4], "prompt 4: is a dict with keys ['tokens']; expected 'prompt' or "
                   "'prompt_token_ids'")
    assert refused(outs[5], "prompt 5: is a NoneType; expected a string, a list of token ids")


def test_calls_wrong_as_a_whole_raise(tiny_target):
    """No request could be formed: a ValueError naming what was given and what is expected."""
    llm = LLM(tiny_target, dtype="float32")
    for prompts, message in ((42, "prompts is a int; expected a prompt"),
                             (None, "prompts is a NoneType"), ((), "no prompts given")):
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate(prompts, greedy())
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts; expected one for"):
        llm.generate([[1]], [greedy(), greedy()])
    with pytest.raises(ValueError, match="sampling_params is a dict; expected a SamplingParams"):
        llm.generate([[1]], {"temperature": 0.0})


def changed(**values):
    """Valid SamplingParams changed after construction (nothing checks a plain assignment)."""
    params = greedy()
    for key, value in values.items():
        setattr(params, key, value)
    return params


# (prompt, params, what the error says after "prompt INDEX: ")
BAD_REQUESTS = [
    ([], greedy(), "is empty; expected at least one token"),
    ([1, 96], greedy(), "has token ids outside [0, 96): [96]; expected integers in [0, 96)"),
    (list(range(40)), greedy(), "has 40 tokens; max_model_len is 32, so expected at most 31"),
    ([1, 2], changed(temperature=-1.0),
     "SamplingParams: invalid value for 'temperature': -1.0; expected a number in [0.0, inf]"),
    ([1, 2], changed(top_p=2),
     "SamplingParams: invalid value for 'top_p': 2; expected a number in (0.0, 1.0]"),
    ([1, 2], changed(max_tokens=0),
     "SamplingParams: invalid value for 'max_tokens': 0; expected an integer >= 1"),
    ([1, 2], "greedy", "its sampling params are a str; expected a SamplingParams"),
    ([1, 2], greedy(stop_token_ids=[5, 96]),
     "SamplingParams: invalid value for 'stop_token_ids': [5, 96]; expected ids in [0, 96)"),
]
GOOD_REQUESTS = [  # greedy, seeded sampled (top-p), greedy with another length
    ([1, 2, 3], greedy(max_tokens=20)),
    ([4, 5, 6, 7], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=7)),
    ([11, 12, 11, 12], greedy(max_tokens=12)),
]


@pytest.mark.parametrize("target, method", [("tiny_target", None), ("loopy_target", "ngram"),
                                            ("tiny_target", "draft_model")])
def test_bad_requests_fail_alone(request, twin_draft, target, method):
    """Bad requests interleaved with good ones: each bad one gets its own error naming its
    index, and each good one gets exactly the tokens it gets when generated alone (with
    drafts accepted and rejected: the loopy target repeats itself, the twin draft is right
    on greedy rows)."""
    spec = {None: None,
            "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                      "prompt_lookup_max": 2},
            "draft_model": {"method": "draft_model", "model": twin_draft,
                            "num_speculative_tokens": 3}}[method]
    target = request.getfixturevalue(target)
    engine = dict(speculative_config=spec, dtype="float32", max_model_len=32, max_num_seqs=2)
    batch = [BAD_REQUESTS[0], GOOD_REQUESTS[0], *BAD_REQUESTS[1:3], GOOD_REQUESTS[1],
             *BAD_REQUESTS[3:5], GOOD_REQUESTS[2], *BAD_REQUESTS[5:]]
    llm = LLM(target, **engine)
    outs = llm.generate([b[0] for b in batch], [b[1] for b in batch])
    assert method is None or llm.get_metrics()["num_accepted_tokens"] > 0
    solo = LLM(target, **engine)
    for i, (request, out) in enumerate(zip(batch, outs)):
        assert out.request_id == i
        if len(request) == 2:  # a good one
            alone = solo.generate([request[0]], request[1])[0]
            assert out.error is None and out.finish_reason == alone.finish_reason
            assert out.token_ids == alone.token_ids and len(out.token_ids) > 0
        else:
            assert refused(out, f"prompt {i}: {request[2]}")


def test_changed_params_shared_by_all_prompts(tiny_target):
    """One SamplingParams for every prompt, made invalid after construction: every request is
    refused (nothing raises), and the params are checked again on the next call."""
    llm = LLM(tiny_target, dtype="float32")
    params = greedy()
    params.top_k = -5
    outs = llm.generate([[1, 2], [3]], params)
    assert all(refused(o, f"prompt {i}: SamplingParams: invalid value for 'top_k': -5")
               for i, o in enumerate(outs))
    params.top_k = 0
    assert [o.error for o in llm.generate([[1, 2], [3]], params)] == [None, None]


@pytest.mark.parametrize("speculative", [False, True])
def test_prompt_too_long_fails_alone(tiny_target, twin_draft, speculative):
    """The long prompt gets finish_reason "error" and a message; the others still complete."""
    spec = ({"method": "draft_model", "model": twin_draft, "num_speculative_tokens": 3}
            if speculative else None)
    llm = LLM(tiny_target, speculative_config=spec, dtype="float32", max_model_len=16,
              max_num_seqs=2)
    prompts = [list(range(16)), [1, 2, 3], list(range(30)), list(range(40, 55)), [4, 5]]
    outs = llm.generate(prompts, greedy())
    for i, n in ((0, 16), (2, 30)):
        assert outs[i].finish_reason == "error"
        assert outs[i].token_ids == []
        assert f"{n} tokens" in outs[i].error and "max_model_len is 16" in outs[i].error
    good = [outs[1], outs[3], outs[4]]
    assert [o.finish_reason for o in good] == ["length"] * 3
    assert all(o.error is None for o in good)
    assert [len(o.token_ids) for o in good] == [8, 1, 8]  # 15-token prompt: 1 token fits
    alone = LLM(tiny_target, dtype="float32").generate([[1, 2, 3], [4, 5]], greedy())
    assert [outs[1].token_ids, outs[4].token_ids] == [o.token_ids for o in alone]


def test_unknown_method_lists_served_methods(tiny_target, tiny_draft):
    with pytest.raises(ValueError) as err:
        LLM(tiny_target, speculative_config={"method": "foo", "num_speculative_tokens": 2})
    msg = str(err.value)
    assert "'method'" in msg and "'foo'" in msg and "ngram" in msg and "draft_model" in msg
    # a method of vLLM's schema that this engine does not serve
    unserved = [m for m in METHODS if m not in served_methods() and m not in ("ngram", "suffix")]
    if not unserved:
        pytest.skip("every schema method is served")
    with pytest.raises(ValueError) as err:
        LLM(tiny_target, speculative_config={"method": unserved[0], "model": tiny_draft,
                                             "num_speculative_tokens": 2})
    msg = str(err.value)
    assert repr(unserved[0]) in msg and "serves" in msg
    for name in served_methods():
        assert name in msg


def test_missing_model_directory(tiny_target, tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        LLM(missing)
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        LLM(tiny_target, speculative_config={"method": "draft_model", "model": missing,
                                             "num_speculative_tokens": 2})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(str(empty))):
        LLM(str(empty))


def test_draft_with_other_vocabulary(tiny_target, make_tiny_llama):
    draft = make_tiny_llama("vocab64", vocab=64, hidden=16, layers=1, heads=2, kv_heads=1)
    with pytest.raises(ValueError) as err:
        LLM(tiny_target, speculative_config={"method": "draft_model", "model": draft,
                                             "num_speculative_tokens": 2})
    msg = str(err.value)
    assert "vocab_size" in msg and "64" in msg and "96" in msg and draft in msg


def test_tensor_parallel_size(tiny_target):
    with pytest.raises(ValueError) as err:
        LLM(tiny_target, tensor_parallel_size=2)
    assert "'tensor_parallel_size'" in str(err.value) and ": 2;" in str(err.value)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tiny_target, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                             "tensor_parallel_size": 2})


def test_pard_without_mask_token(tiny_target, tiny_draft):
    with pytest.raises(ValueError) as err:
        LLM(tiny_target, speculative_config={"method": "draft_model", "model": tiny_draft,
                                             "num_speculative_tokens": 2,
                                             "parallel_drafting": True})
    msg = str(err.value)
    assert "pard_token" in msg and "config.json" in msg and tiny_draft in msg


def test_text_prompt_without_tokenizer(tiny_target):
    llm = LLM(tiny_target, dtype="float32")
    text = llm.generate("def f():", greedy())[0]
    assert refused(text, "prompt 0: is text but the model directory has no tokenizer")
    assert text.prompt == "def f():"
    ids, text = llm.generate([[1, 2], {"prompt": "x = 1"}], greedy())
    assert refused(text, "prompt 1: is text") and ids.error is None


def test_text_prompt_with_tokenizer(tiny_target, tmp_path):
    """A word-level tokenizer saved beside the weights: text in, text out."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    model_dir = tmp_path / "with_tokenizer"
    shutil.copytree(tiny_target, model_dir)
    vocab = {f"w{i}": i for i in range(95)} | {"<eos>": 95}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(model_dir)
    llm = LLM(str(model_dir), dtype="float32")
    assert 95 in llm.eos_ids  # the tokenizer's EOS stops generation too
    text, ids = llm.generate(["w1 w2 w3", [1, 2, 3]], greedy(ignore_eos=True))
    assert text.prompt == "w1 w2 w3" and text.prompt_token_ids == [1, 2, 3]
    assert text.token_ids == ids.token_ids
    assert text.text.split() == [f"w{t}" for t in text.token_ids if t != 95]


def test_bad_engine_arguments(tiny_target):
    with pytest.raises(ValueError, match="'max_num_seqs'"):
        LLM(tiny_target, max_num_seqs=0)
    with pytest.raises(ValueError, match="'max_model_len'.*256"):
        LLM(tiny_target, max_model_len=1000)
    with pytest.raises(ValueError, match="'dtype'"):
        LLM(tiny_target, dtype="fp8")


def test_memory_budget_names_the_sizes():
    from infer.engine_checks import check_memory_budget, kv_cache_bytes
    from infer.models.llama import ModelConfig

    cfg = ModelConfig(vocab_size=8, hidden_size=8, num_layers=32, num_heads=32, num_kv_heads=8,
                      head_dim=128, intermediate_size=8)  # Llama-3-8B's cache geometry
    per_seq = kv_cache_bytes(cfg, 1, 8191, torch.bfloat16)
    assert per_seq == 8192 * 128 * 1024  # 128 KiB per token: 1 GiB for 8192 tokens
    gib = 2 ** 30
    check_memory_budget(16 * gib, 8 * per_seq, 80 * gib, 0.9, 8, 8191)  # 24 of 72 GiB: fits
    with pytest.raises(ValueError) as e:
        check_memory_budget(16 * gib, 64 * per_seq, 80 * gib, 0.9, 64, 8191)
    for part in ("'gpu_memory_utilization'", "0.9", "16.00 GiB", "64.00 GiB",
                 "max_num_seqs=64 x max_model_len=8191", "72.00 GiB"):
        assert part in str(e.value)
