"""Training data: loss masks on several chat templates, formats, loading, packing, caching.

Every tokenizer is a byte-level BPE trained in-process on a few strings (milliseconds); every
dataset is written to tmp_path and read back through the real ``datasets`` loaders.
"""

import json
import pickle
import random

import datasets
import pytest
import torch
import torch.nn.functional as F
from datasets.fingerprint import Hasher
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from train import data as D
from train.data_formats import assistant_char_spans, detect_format, load_source
from train.tiny import examples
from train.tiny.corpus import train_tokenizer

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Like Qwen3: only the LAST assistant turn carries a (here empty) think block, so the render of
# messages[:i+1] is not a prefix of the full render for earlier turns.
THINK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONVO = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four ✓ é."},
    {"role": "user", "content": "And times three?"},
    {"role": "assistant", "content": "Twelve, since 4 * 3 = 12.\nDone"},
]
ANSWERS = ["Four ✓ é.", "Twelve, since 4 * 3 = 12.\nDone"]
CORPUS = [m["content"] for m in CONVO] + ["def f(x):\n    return x + 1\n", "hello world"] * 3


def bpe_tokenizer(specials, template, *, bos=None, eos, add_bos=False, vocab_size=400):
    """A byte-level BPE with ``specials`` as single tokens; ``add_bos`` adds BOS like Llama 3."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    steps = [processors.ByteLevel(trim_offsets=False)]
    if add_bos:
        steps.append(processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))]))
    tok.post_processor = processors.Sequence(steps)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                   pad_token=specials[0], additional_special_tokens=specials)
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def llama3_tok():
    return bpe_tokenizer(["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>",
                          "<|end_header_id|>", "<|eot_id|>"], LLAMA3_TEMPLATE,
                         bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True)


@pytest.fixture(scope="module")
def chatml_tok():
    return bpe_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], CHATML_TEMPLATE,
                         eos="<|im_end|>")


@pytest.fixture(scope="module")
def think_tok():
    return bpe_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
                         THINK_TEMPLATE, eos="<|im_end|>")


@pytest.fixture(scope="module")
def tiny_tok():
    return train_tokenizer(CORPUS, 400)


def masked_runs(tok, ids, mask):
    """Decoded contiguous runs of loss tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def example(tok, row, fmt="openai", max_length=512):
    return D.Tokenize(tok, fmt, max_length).example(row)


# ----------------------------------------------------------------------------- loss masks

@pytest.mark.parametrize("name,terminator,first,last", [
    ("llama3_tok", "<|eot_id|>", "", ""),
    ("chatml_tok", "<|im_end|>", "", ""),
    ("tiny_tok", "<|end|>", "", ""),
    ("think_tok", "<|im_end|>", "", "<think>\n\n</think>\n\n"),
])
def test_loss_mask_exact_per_template(request, name, terminator, first, last):
    tok = request.getfixturevalue(name)
    ids, mask, truncated = example(tok, {"messages": CONVO})
    assert not truncated and len(ids) == len(mask)
    # the answer and its terminator are targets; headers, prompts and the template's
    # newline after the terminator are not
    assert masked_runs(tok, ids, mask) == [first + ANSWERS[0] + terminator,
                                           last + ANSWERS[1] + terminator]
    # the tokenisation is the plain tokenisation of the full render (one pass, no BOS doubled)
    text = tok.apply_chat_template(CONVO, tokenize=False)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]


def test_llama3_bos_not_doubled(llama3_tok):
    bos = llama3_tok.bos_token_id
    assert llama3_tok("hi")["input_ids"][0] == bos  # the tokenizer itself adds BOS ...
    ids, _, _ = example(llama3_tok, {"messages": CONVO})
    assert ids[0] == bos and ids.count(bos) == 1  # ... and the template does too: one BOS


def test_think_template_falls_back_to_content_anchor(think_tok):
    full, spans = assistant_char_spans(think_tok, CONVO)
    assert [full[s:e] for s, e in spans] == [
        "Four ✓ é.<|im_end|>", "<think>\n\n</think>\n\n" + ANSWERS[1] + "<|im_end|>"]


def test_sharegpt_openai_prompt_completion_agree(chatml_tok):
    sharegpt = [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                 "value": m["content"]} for m in CONVO]
    a = example(chatml_tok, {"messages": CONVO}, "openai")
    b = example(chatml_tok, {"conversations": sharegpt}, "sharegpt")
    assert a == b
    single = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    c = example(chatml_tok, {"messages": single}, "openai")
    d = example(chatml_tok, {"prompt": "Hi?", "completion": "Hello."}, "prompt_completion")
    assert c == d
    assert masked_runs(chatml_tok, c[0], c[1]) == ["Hello.<|im_end|>"]


def test_text_format_trains_every_token_but_the_first(chatml_tok):
    text = "def f(x):\n    return x + 1\n"
    ids, mask, _ = example(chatml_tok, {"text": text}, "text")
    assert chatml_tok.decode(ids) == text  # no template
    assert mask == [0] + [1] * (len(ids) - 1)


def test_trailing_user_turn_is_dropped(chatml_tok):
    with_tail = CONVO + [{"role": "user", "content": "Thanks"}]
    assert example(chatml_tok, {"messages": with_tail}) == example(chatml_tok,
                                                                   {"messages": CONVO})


# ----------------------------------------------------------------------------- formats, loading

ROWS = [{"messages": [{"role": "user", "content": f"question {i}?"},
                      {"role": "assistant", "content": "answer " * (i % 5 + 1)}]}
        for i in range(24)]


def _write_all(tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    ds.to_parquet(str(tmp_path / "rows.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    (tmp_path / "dir").mkdir()
    for k in range(2):
        (tmp_path / "dir" / f"part{k}.jsonl").write_text(
            "\n".join(json.dumps(r) for r in ROWS[k * 12:(k + 1) * 12]))
    return {"json": tmp_path / "rows.json", "jsonl": tmp_path / "rows.jsonl",
            "parquet": tmp_path / "rows.parquet", "save_to_disk": tmp_path / "saved",
            "arrow": arrow, "folder": tmp_path / "dir"}


def test_every_file_format_loads(tmp_path):
    paths = _write_all(tmp_path)
    for kind, path in paths.items():
        ds = load_source(path, cache_dir=str(tmp_path / "hf"))
        assert len(ds) == len(ROWS), kind
        assert detect_format(ds.column_names) == "openai", kind
        got = sorted(r["messages"][0]["content"] for r in ds)
        assert got == sorted(r["messages"][0]["content"] for r in ROWS), kind


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_source(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="'someone/no-such-dataset' is not a local path"):
        load_source("someone/no-such-dataset", cache_dir=str(tmp_path / "hf"))  # offline
    bad = tmp_path / "rows.txt"
    bad.write_text("hello")
    with pytest.raises(ValueError, match=r"rows\.txt.*'\.txt'"):
        load_source(bad)


def test_unknown_format_names_columns_and_formats(chatml_tok):
    ds = datasets.Dataset.from_dict({"question": ["a"], "answer": ["b"]})
    with pytest.raises(ValueError) as e:
        D.prepare_dataset(ds, chatml_tok, max_length=32, verbose=False)
    for word in ("answer", "question", "sharegpt", "openai", "prompt_completion", "text"):
        assert word in str(e.value)
    with pytest.raises(ValueError, match=r"needs columns \['conversations'\].*\['answer'"):
        detect_format(ds.column_names, "sharegpt")
    with pytest.raises(ValueError, match="'format'"):
        detect_format(ds.column_names, "alpaca")


def test_skipped_rows_are_counted(chatml_tok, capsys):
    user = {"role": "user", "content": "Hi?"}
    rows = ([{"messages": [user, {"role": "assistant", "content": "Hello."}]}] * 5
            + [{"messages": [user]}] * 3 + [{"messages": []}] * 2
            + [{"messages": [{"role": "user", "content": "x " * 40},
                             {"role": "assistant", "content": "late"}]}])
    ds = datasets.Dataset.from_list(rows)
    out, stats = D.prepare_dataset(ds, chatml_tok, max_length=32, return_stats=True)
    assert stats.skipped == {"no_assistant": 3, "empty": 2, "no_loss_tokens": 1}
    assert (stats.rows, stats.examples, stats.truncated) == (11, 5, 0)
    assert stats.loss_tokens == 5 * len(chatml_tok("Hello.<|im_end|>")["input_ids"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("data: 11 rows -> 5 examples (2 empty, 3 without assistant turn, "
                           "1 without loss tokens after truncation), ")
    assert f"{stats.tokens} tokens, {stats.loss_tokens} loss tokens" in line


def test_truncation_keeps_the_start(chatml_tok):
    row = {"messages": [{"role": "user", "content": "Hi?"},
                        {"role": "assistant", "content": "answer " * 30}]}
    full, _, _ = example(chatml_tok, row)
    ids, mask, truncated = example(chatml_tok, row, max_length=30)
    assert truncated and ids == full[:30] and len(mask) == 30 and any(mask)


# ----------------------------------------------------------------------------- packing

def test_pack_lengths_best_fit():
    lengths = [5, 9, 3, 7, 1, 10, 2, 4]
    bins = D.pack_lengths(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert bins == D.pack_lengths(lengths, 10)
    assert len(bins) == 5  # sum 41 -> at least 5 bins of 10
    with pytest.raises(ValueError, match="11 tokens"):
        D.pack_lengths([11], 10)


@pytest.fixture(scope="module")
def varied_rows():
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "return", "value"]
    say = lambda k: " ".join(rng.choices(words, k=rng.randint(1, k)))  # noqa: E731
    return [{"messages": [{"role": "user", "content": say(8)},
                          {"role": "assistant", "content": say(12)}]} for _ in range(40)]


def test_packing_keeps_documents_apart(chatml_tok, varied_rows):
    ds = datasets.Dataset.from_list(varied_rows)
    T = 160
    docs = D.prepare_dataset(ds, chatml_tok, max_length=T, pack=False, verbose=False)
    packed = D.prepare_dataset(ds, chatml_tok, max_length=T, verbose=False)
    assert len(docs) == len(varied_rows) and len(packed) < len(docs) / 2
    pad = chatml_tok.pad_token_id
    rebuilt = []
    for row in packed.with_format("torch"):
        ids, mask, pos, doc = (row[k] for k in ("input_ids", "loss_mask", "position_ids",
                                                "doc_ids"))
        assert ids.shape == (T,)
        for d in doc.unique().tolist():
            sel = (doc == d).nonzero().squeeze(-1)
            assert torch.equal(sel, torch.arange(sel[0], sel[-1] + 1))  # contiguous
            assert torch.equal(pos[sel], torch.arange(len(sel)))  # positions restart
            if d == int(doc.max()) and bool((ids[sel] == pad).all()) and mask[sel].sum() == 0:
                continue  # the padding block
            rebuilt.append((ids[sel].tolist(), mask[sel].tolist()))
        # the mask is exactly block-diagonal causal
        ref = torch.zeros(T, T, dtype=torch.bool)  # one causal block per document
        for d in doc.unique().tolist():
            a, b = int((doc == d).nonzero().min()), int((doc == d).nonzero().max()) + 1
            ref[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        assert torch.equal(D.document_attention_mask(doc), ref)
    expected = sorted((r["input_ids"], r["loss_mask"]) for r in docs)
    assert sorted(rebuilt) == expected


def test_attention_never_crosses_documents():
    torch.manual_seed(0)
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])  # [T]; doc 2 is padding
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    mask = D.document_attention_mask(doc)  # [T, T]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    k2, v2 = k.clone(), v.clone()
    k2[..., :3, :] += 5.0  # change document 0 only
    v2[..., :3, :] -= 3.0
    out2 = F.scaled_dot_product_attention(q, k2, v2, attn_mask=mask)
    assert torch.allclose(out[..., 3:, :], out2[..., 3:, :])
    assert not torch.allclose(out[..., :3, :], out2[..., :3, :])
    assert not torch.isnan(out).any()
    batched = D.document_attention_mask(torch.stack([doc, doc.flip(0)]))  # [B, T, T]
    assert batched.shape == (2, 8, 8) and torch.equal(batched[0], mask)


def test_collate_pads_unpacked_rows():
    rows = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [0]}]
    b = D.collate(rows, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["loss_mask"].tolist() == [[False, True, True], [False, False, False]]
    assert b["position_ids"].tolist() == [[0, 1, 2], [0, 0, 1]]
    assert b["doc_ids"].tolist() == [[0, 0, 0], [0, 1, 1]]


# ----------------------------------------------------------------------------- determinism, cache

def test_shuffle_is_seeded(chatml_tok, varied_rows):
    ds = datasets.Dataset.from_list(varied_rows)
    run = lambda seed: D.prepare_dataset(ds, chatml_tok, max_length=64, pack=False, seed=seed,
                                         verbose=False)["input_ids"]
    a, b, c = run(0), run(0), run(1)
    assert list(a) == list(b) and list(a) != list(c)
    assert sorted(a) == sorted(c)


def test_num_proc_matches_single_process_and_caches(chatml_tok, varied_rows, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in varied_rows))
    kw = dict(max_length=160, verbose=False, return_stats=True)
    # separate caches: a num_proc=2 run must not just read the num_proc=1 run's cache
    one, s1 = D.prepare_dataset(str(path), chatml_tok, num_proc=1,
                                cache_dir=str(tmp_path / "hf1"), **kw)
    two, s2 = D.prepare_dataset(str(path), chatml_tok, num_proc=2,
                                cache_dir=str(tmp_path / "hf2"), **kw)
    assert list((tmp_path / "hf2").rglob("*_00001_of_00002.arrow"))  # really two workers
    assert one.to_dict() == two.to_dict() and s1 == s2
    # the map function pickles and fingerprints deterministically, so the cache is reused
    fn = D.Tokenize(chatml_tok, "openai", 48)
    again = D.Tokenize(bpe_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                     CHATML_TEMPLATE, eos="<|im_end|>"), "openai", 48)
    assert Hasher.hash(fn) == Hasher.hash(again)
    assert pickle.loads(pickle.dumps(fn)).example(ROWS[0]) == fn.example(ROWS[0])
    src = load_source(path, cache_dir=str(tmp_path / "hf"))
    t1, _ = D.tokenize_dataset(src, chatml_tok, max_length=48)
    t2, _ = D.tokenize_dataset(src, chatml_tok, max_length=48)
    assert t1.cache_files and t1.cache_files == t2.cache_files


# ----------------------------------------------------------------------------- embedded default

def _write_corpus(root, n=12):
    rng = random.Random(0)
    for i in range(n):
        lines = [f'"""Module {i}."""', "", "import os", ""]
        for j in range(6):
            lines += [f"def func_{i}_{j}(x, y={j}):", f"    z = x * y + {rng.randint(0, 99)}",
                      "    if z > 10:", "        return z - 1", "    return z", ""]
        (root / f"mod_{i:02d}.py").write_text("\n".join(lines))


def test_default_dataset_from_train_files(tmp_path, tiny_tok):
    from train.tiny.corpus import stdlib_corpus
    _write_corpus(tmp_path)
    train_files, held_files = stdlib_corpus(0, 0.1, tmp_path)
    train_text = [(tmp_path / f).read_text() for f in train_files]
    held_text = [(tmp_path / f).read_text() for f in held_files]
    kw = dict(root=tmp_path, prompt_chars=(60, 120), completion_chars=(30, 80))
    ds = examples.build_default_dataset(30, seed=0, **kw)
    assert ds.column_names == ["prompt", "completion"] and len(ds) == 30
    assert ds.to_dict() == examples.build_default_dataset(30, seed=0, **kw).to_dict()
    assert ds["prompt"] != examples.build_default_dataset(30, seed=1, **kw)["prompt"]
    for p, c in zip(ds["prompt"], ds["completion"]):
        assert any(p + "\n" + c in t for t in train_text)
    prompts = examples.heldout_prompts(4, root=tmp_path, prompt_chars=(60, 120))
    assert len(prompts) == 4 and all(any(p in t for t in held_text) for p in prompts)
    out = D.prepare_dataset(ds, tiny_tok, max_length=128, verbose=False)
    assert len(out) > 0 and sum(map(sum, out["loss_mask"])) > 0
