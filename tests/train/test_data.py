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
from train.data_formats import TRUNCATED_COLUMN, conversation_examples, detect_format, load_source
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

# Qwen3's template (tool calls left out): the think block of every answer before the last user
# message is stripped, the answers after it keep theirs, enable_thinking=false pre-fills an empty
# think block in the generation prompt.
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}{%- set content = message.content %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
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
def qwen3_tok():
    return bpe_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
                         QWEN3_TEMPLATE, eos="<|im_end|>")


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


def row_examples(tok, row, fmt="openai", max_length=512, **template_kwargs):
    return D.Tokenize(tok, fmt, max_length, template_kwargs).examples(row)


def example(tok, row, fmt="openai", max_length=512):
    """The row's only example."""
    (one,) = row_examples(tok, row, fmt, max_length)
    return one


# ----------------------------------------------------------------------------- loss masks

@pytest.mark.parametrize("name,terminator,first,last", [
    ("llama3_tok", "<|eot_id|>", "", ""),
    ("chatml_tok", "<|im_end|>", "", ""),
    ("tiny_tok", "<|end|>", "", ""),
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


def test_template_without_prefix_property_gives_one_example_per_turn(think_tok):
    texts = conversation_examples(think_tok, CONVO)
    # each answer is the last turn of its own example, rendered as the model generated it
    assert [text for text, _ in texts] == [think_tok.apply_chat_template(CONVO[:k], tokenize=False)
                                           for k in (3, 5)]
    assert [[t[s:e] for s, e in spans] for t, spans in texts] == [
        ["<think>\n\n</think>\n\n" + a + "<|im_end|>"] for a in ANSWERS]


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
    assert pickle.loads(pickle.dumps(fn)).examples(ROWS[0]) == fn.examples(ROWS[0])
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


# ----------------------------------------------------------------------------- thinking, cuts

def thinking_convo(turns=3):
    """A conversation whose answers were generated with thinking on (think block kept)."""
    messages = [{"role": "system", "content": "You are terse."}]
    for t in range(turns):
        messages += [{"role": "user", "content": f"Question {t}: two plus {t}?"},
                     {"role": "assistant",
                      "content": f"<think>\nAdd {t} to two.\n</think>\n\nIt is {2 + t}."}]
    return messages


def test_qwen3_multi_turn_thinking_keeps_every_turn_with_its_think_block(qwen3_tok):
    """Each answer is trained in the context serving gives it (earlier think blocks stripped)
    and as the model generated it (its own think block and the terminator)."""
    messages = thinking_convo(3)
    got = row_examples(qwen3_tok, {"messages": messages})
    assert len(got) == 3  # one example per assistant turn, none dropped
    for t, (ids, mask, truncated) in enumerate(got):
        turn = messages[: 2 * t + 3]
        prompt = qwen3_tok.apply_chat_template(turn[:-1], tokenize=False,
                                               add_generation_prompt=True)
        text = qwen3_tok.decode(ids, skip_special_tokens=False)
        assert text == qwen3_tok.apply_chat_template(turn, tokenize=False)
        assert text.startswith(prompt) and "Add" not in prompt  # earlier thinking stripped
        assert masked_runs(qwen3_tok, ids, mask) == [turn[-1]["content"] + "<|im_end|>"]
        assert not truncated
    stats = D.tokenize_dataset(datasets.Dataset.from_list([{"messages": messages}] * 4),
                               qwen3_tok, max_length=512)[1]
    assert (stats.rows, stats.examples, stats.skipped) == (4, 12, {})


def test_enable_thinking_false_reaches_the_template(qwen3_tok):
    """Answers of a non-thinking run: the empty think block is prompt, not a target."""
    messages = [m if m["role"] != "assistant" else {**m, "content": f"It is {i}."}
                for i, m in enumerate(thinking_convo(2))]
    got = row_examples(qwen3_tok, {"messages": messages}, enable_thinking=False)
    assert [masked_runs(qwen3_tok, ids, mask) for ids, mask, _ in got] == [
        ["It is 2.<|im_end|>"], ["It is 4.<|im_end|>"]]
    for ids, mask, _ in got:
        first = mask.index(1)
        assert qwen3_tok.decode(ids[:first], skip_special_tokens=False).endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_answer_cut_inside_its_think_block_trains_as_generated(qwen3_tok):
    """No empty think block invented before it (what Qwen3's template would render), no
    terminator after it."""
    messages = thinking_convo(1)
    messages[-1] = {"role": "assistant", "content": "<think>\nAdd zero to two, then"}
    row = {"messages": messages, TRUNCATED_COLUMN: [2]}
    ((ids, mask, _),) = row_examples(qwen3_tok, row)
    prompt = qwen3_tok.apply_chat_template(messages[:2], tokenize=False,
                                           add_generation_prompt=True)
    assert qwen3_tok.decode(ids, skip_special_tokens=False) == prompt + messages[-1]["content"]
    assert masked_runs(qwen3_tok, ids, mask) == [messages[-1]["content"]]


def test_truncated_middle_turn_is_context_and_its_own_example(chatml_tok):
    """ChatML keeps the prefix property: the conversation is one example in which the cut answer
    is context only, and the cut answer is a second example without a terminator."""
    row = {"messages": CONVO, TRUNCATED_COLUMN: [2]}
    (whole, cut) = row_examples(chatml_tok, row)
    assert masked_runs(chatml_tok, whole[0], whole[1]) == [ANSWERS[1] + "<|im_end|>"]
    assert chatml_tok.decode(whole[0]) == chatml_tok.apply_chat_template(CONVO, tokenize=False)
    assert masked_runs(chatml_tok, cut[0], cut[1]) == [ANSWERS[0]]
    assert chatml_tok.decode(cut[0]).endswith("<|im_start|>assistant\n" + ANSWERS[0])
    # the last real token is a target; nothing after it is
    assert cut[1][-1] == 1 and chatml_tok.decode(cut[0][-1:]) == ANSWERS[0][-1:]


def test_more_than_five_percent_dropped_warns(chatml_tok, caplog):
    good = {"messages": [{"role": "user", "content": "Hi?"},
                         {"role": "assistant", "content": "Hello."}]}
    bad = {"messages": [{"role": "user", "content": "Hi?"}]}
    with caplog.at_level("WARNING", logger="train.data"):
        D.prepare_dataset(datasets.Dataset.from_list([good] * 19 + [bad]), chatml_tok,
                          max_length=32, verbose=False)
    assert not caplog.records  # exactly 5 %: no warning
    with caplog.at_level("WARNING", logger="train.data"):
        D.prepare_dataset(datasets.Dataset.from_list([good] * 18 + [bad] * 2), chatml_tok,
                          max_length=32, verbose=False)
    (record,) = caplog.records
    assert "10.0% of the 20 conversations were dropped" in record.getMessage()
    assert "without assistant turn (2)" in record.getMessage()
