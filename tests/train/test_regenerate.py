"""Regeneration: the target's own answers through the engine, turn by turn, resumable."""

import importlib.util
import json
import os
import re

import datasets
import pytest
from transformers import AutoTokenizer

from infer import LLM, SamplingParams
from infer.models.loader import load_config
from infer.request import CompletionOutput
from train.config import RegenerateConfig
from train.data import prepare_dataset
from train.regenerate import Regenerator, regenerate

from .conftest import chat_rows, thinking_target

CFG = RegenerateConfig(enabled=True, temperature=0.0, max_tokens=8, batch_size=2)


@pytest.fixture
def calls(monkeypatch):
    """Every ``LLM.generate`` call's prompts (token-id lists), in order."""
    seen, real = [], LLM.generate

    def spy(self, prompts, params=None, **kw):
        seen.append([list(p) for p in prompts])
        return real(self, prompts, params, **kw)

    monkeypatch.setattr(LLM, "generate", spy)
    return seen


def rendered(tok, history):
    """The generation prompt's ids (the tiny tokenizer adds no BOS)."""
    text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def reference_cut(target, prompts, max_tokens=8):
    """What the engine answers, called directly (greedy), stop token removed by hand, and
    whether each answer was cut by max_tokens."""
    tok = AutoTokenizer.from_pretrained(target)
    end = tok.convert_tokens_to_ids("<|end|>")
    outs = LLM(target, device="cpu").generate(prompts, SamplingParams(temperature=0.0,
                                                                      max_tokens=max_tokens))
    answers = []
    for out in outs:
        ids = out.token_ids[:-1] if out.token_ids[-1:] == [end] else out.token_ids
        answers.append((tok.decode(ids, skip_special_tokens=False), ids == out.token_ids))
    return answers


def reference(target, prompts, max_tokens=8):
    return [answer for answer, _ in reference_cut(target, prompts, max_tokens)]


def trained_text(answer: str, cut: bool) -> str:
    """The loss tokens of an answer: a cut answer gets no terminator."""
    return answer if cut else answer + "<|end|>"


def test_chat_answers_are_the_engines_and_prompts_unchanged(tmp_path, train_target, calls):
    rows = [dict(r, id=f"row{i}") for i, r in enumerate(chat_rows(5, seed=5))]
    out = regenerate(datasets.Dataset.from_list(rows), train_target, CFG, tmp_path,
                     device="cpu", progress=False)
    tok = AutoTokenizer.from_pretrained(train_target)
    prompts = [rendered(tok, r["messages"][:1]) for r in rows]
    assert [p for call in calls for p in call] == prompts  # one turn each, batched in one call
    assert out.column_names == ["messages", "id", "truncated_turns"] and len(out) == 5
    answers = reference_cut(train_target, prompts)
    assert any(cut for _, cut in answers)
    for row, new, (want, cut) in zip(rows, out, answers):
        assert new["id"] == row["id"] and new["messages"][0] == row["messages"][0]
        assert new["messages"][1] == {"role": "assistant", "content": want}
        assert new["truncated_turns"] == ([1] if cut else [])
        assert want != row["messages"][1]["content"]
    assert out.to_list() == datasets.load_from_disk(str(tmp_path / "dataset")).to_list()


def test_prompt_completion_rows_string_and_conversational(tmp_path, train_target):
    tok = AutoTokenizer.from_pretrained(train_target)
    rows = [{"prompt": "class Point:", "completion": "pass"},
            {"prompt": "def add(a, b):", "completion": "return a + b"}]
    out = regenerate(datasets.Dataset.from_list(rows), train_target, CFG, tmp_path / "s",
                     device="cpu", progress=False)
    want = reference_cut(train_target, [rendered(tok, [{"role": "user", "content": r["prompt"]}])
                                        for r in rows])
    assert out.to_list() == [{"prompt": r["prompt"], "completion": w,
                              "truncated_turns": [1] if cut else []}
                             for r, (w, cut) in zip(rows, want)]
    packed = prepare_dataset(out, tok, max_length=128, pack=False, shuffle=False, verbose=False)
    for row, (w, cut) in zip(packed, want):  # trains as the pipeline trains prompt/completion
        assert tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]) == (
            trained_text(w, cut))
    trl = [{"prompt": [{"role": "user", "content": "for i in range(3):"}],
            "completion": [{"role": "assistant", "content": "print(i)"}]}]
    out = regenerate(datasets.Dataset.from_list(trl), train_target, CFG, tmp_path / "t",
                     device="cpu", progress=False)
    assert out[0]["prompt"] == trl[0]["prompt"]
    assert out[0]["completion"] == [{"role": "assistant", "content": reference(
        train_target, [rendered(tok, trl[0]["prompt"])])[0]}]


def test_multi_turn_conditions_on_the_regenerated_earlier_answer(tmp_path, train_target,
                                                                  calls):
    """ShareGPT rows; turn 2 of both conversations is generated in one batch after turn 1."""
    def conv(a, b, c, d):
        return {"conversations": [{"from": "human", "value": a}, {"from": "gpt", "value": b},
                                  {"from": "human", "value": c}, {"from": "gpt", "value": d}]}
    rows = [conv("def add(a, b):", "return a + b", "for i in range(3):", "print(i)"),
            conv("class Point:", "pass", "with open(path) as f:", "data = f.read()")]
    out = regenerate(datasets.Dataset.from_list(rows), train_target, CFG, tmp_path,
                     device="cpu", progress=False)
    tok = AutoTokenizer.from_pretrained(train_target)
    assert len(calls) == 2 and [len(c) for c in calls] == [2, 2]
    for k, (row, new) in enumerate(zip(rows, out)):
        old, msgs = row["conversations"], new["conversations"]
        assert [m["from"] for m in msgs] == ["human", "gpt", "human", "gpt"]
        assert msgs[0] == old[0] and msgs[2] == old[2]
        first = msgs[1]["value"]
        history = [{"role": "user", "content": old[0]["value"]},
                   {"role": "assistant", "content": first},
                   {"role": "user", "content": old[2]["value"]}]
        second_prompt = calls[1][k]
        assert second_prompt == rendered(tok, history)
        assert first in tok.decode(second_prompt) and old[1]["value"] not in tok.decode(
            second_prompt)
        assert msgs[3]["value"] == reference(train_target, [second_prompt])[0]


def test_interrupted_run_resumes_with_only_the_missing_chunks(tmp_path, train_target,
                                                              monkeypatch):
    """Sampled (seeded per chunk): the resumed data equals an uninterrupted run's."""
    cfg = RegenerateConfig(enabled=True, temperature=0.8, top_p=0.9, max_tokens=6, batch_size=2)
    ds = datasets.Dataset.from_list(chat_rows(6, seed=1))
    asked, real, fail_at = [], LLM.generate, [2]

    def counting(self, prompts, params=None, **kw):
        if len(asked) + 1 == fail_at[0]:
            raise KeyboardInterrupt("simulated interruption")
        asked.append(len(prompts))
        return real(self, prompts, params, **kw)

    monkeypatch.setattr(LLM, "generate", counting)
    kw = dict(device="cpu", progress=False, chunk_size=2)
    with pytest.raises(KeyboardInterrupt):
        regenerate(ds, train_target, cfg, tmp_path / "run", **kw)
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == ["chunk_00000.jsonl", "fingerprint.json", "stats.json"]  # no tmp left over
    asked.clear()
    fail_at[0] = 0
    resumed = regenerate(ds, train_target, cfg, tmp_path / "run", **kw)
    assert asked == [2, 2]  # chunks 1 and 2 only: 4 requests
    asked.clear()
    fresh = regenerate(ds, train_target, cfg, tmp_path / "fresh", **kw)
    assert asked == [2, 2, 2]
    assert resumed.to_list() == fresh.to_list()
    assert json.loads((tmp_path / "run" / "stats.json").read_text())["0"]["answers"] == 2
    asked.clear()
    assert regenerate(ds, train_target, cfg, tmp_path / "run", **kw).to_list() == fresh.to_list()
    assert asked == []  # complete: nothing generated, no engine built


def test_changed_settings_or_data_are_named(tmp_path, train_target):
    ds = datasets.Dataset.from_list(chat_rows(2))
    regenerate(ds, train_target, CFG, tmp_path, device="cpu", progress=False)
    hotter = RegenerateConfig(enabled=True, temperature=0.7, max_tokens=8, batch_size=2)
    changed = rf"{tmp_path}.*'temperature': its answers have 0\.0, this run has 0\.7"
    with pytest.raises(ValueError, match=changed):
        regenerate(ds, train_target, hotter, tmp_path, device="cpu", progress=False)
    other = datasets.Dataset.from_list(chat_rows(2, seed=9))
    with pytest.raises(ValueError, match="'rows_digest'.*Delete"):
        regenerate(other, train_target, CFG, tmp_path, device="cpu", progress=False)
    faster = RegenerateConfig(enabled=True, temperature=0.0, max_tokens=8, batch_size=4)
    assert len(regenerate(ds, train_target, faster, tmp_path, progress=False)) == 2  # speed only
    saved = json.loads((tmp_path / "fingerprint.json").read_text())
    assert saved["device"] == "cpu" and saved["batch_size"] is None  # greedy: not recorded
    for key, old in (("device", "cuda"), ("version", 3)):  # GPU answers; an older format
        (tmp_path / "fingerprint.json").write_text(json.dumps({**saved, key: old}))
        with pytest.raises(ValueError, match=rf"'{key}': its answers have {old!r}, this run has"):
            regenerate(ds, train_target, CFG, tmp_path, device="cpu", progress=False)


def test_sampled_batch_size_is_in_the_fingerprint(tmp_path, train_target, monkeypatch):
    """Sampled answers depend on the batch size (one generator feeds the running batch), so an
    interrupted sampled run resumed with another regenerate.batch_size is refused instead of
    mixing answers of both; greedy ones do not (test_changed_settings_or_data_are_named)."""
    ds = datasets.Dataset.from_list(chat_rows(6, seed=1))
    kw = dict(device="cpu", progress=False, chunk_size=3)
    sampled = dict(enabled=True, temperature=1.0, max_tokens=6)
    by_two = regenerate(ds, train_target, RegenerateConfig(**sampled, batch_size=2),
                        tmp_path / "two", **kw)
    by_one = regenerate(ds, train_target, RegenerateConfig(**sampled, batch_size=1),
                        tmp_path / "one", **kw)
    assert by_two.to_list() != by_one.to_list()  # the premise: the setting changes the rows
    real = LLM.generate

    def interrupted_after_one_chunk(self, prompts, params=None, **kw):
        if (tmp_path / "run" / "chunk_00000.jsonl").exists():
            raise KeyboardInterrupt("simulated interruption")
        return real(self, prompts, params, **kw)

    monkeypatch.setattr(LLM, "generate", interrupted_after_one_chunk)
    with pytest.raises(KeyboardInterrupt):
        regenerate(ds, train_target, RegenerateConfig(**sampled, batch_size=2), tmp_path / "run",
                   **kw)
    monkeypatch.setattr(LLM, "generate", real)
    with pytest.raises(ValueError, match=r"'batch_size': its answers have 2, this run has 1.*"
                                         r"Delete"):
        regenerate(ds, train_target, RegenerateConfig(**sampled, batch_size=1), tmp_path / "run",
                   **kw)
    resumed = regenerate(ds, train_target, RegenerateConfig(**sampled, batch_size=2),
                         tmp_path / "run", **kw)
    assert resumed.to_list() == by_two.to_list()


def test_text_rows_cannot_be_regenerated(tmp_path, train_target):
    with pytest.raises(ValueError, match="format 'text' has no prompts"):
        regenerate(datasets.Dataset.from_list([{"text": "x = 1"}]), train_target, CFG, tmp_path)
    assert not tmp_path.joinpath("fingerprint.json").exists()


def test_stop_token_and_template_terminator_are_dropped(train_target):
    gen = Regenerator(train_target, CFG, seed=0, device="cpu")
    tok = gen.tokenizer
    end = tok.convert_tokens_to_ids("<|end|>")
    assert gen.terminator == "<|end|>" and gen.params.stop_token_ids == [end]
    body = tok("x = 1", add_special_tokens=False)["input_ids"]
    assert gen.answer(CompletionOutput(0, "", body + [end], "stop")) == "x = 1"
    assert gen.answer(CompletionOutput(0, "", body, "length")) == "x = 1"


def test_output_feeds_prepare_dataset_with_assistant_only_masks(tmp_path, train_target):
    rows = chat_rows(3) + [{"messages": [{"role": "user", "content": "no answer"}]}]
    out = regenerate(datasets.Dataset.from_list(rows), train_target, CFG, tmp_path,
                     device="cpu", progress=False)
    assert out[3] == {**rows[3], "truncated_turns": []}  # unusable rows kept unchanged
    tok = AutoTokenizer.from_pretrained(train_target)
    packed = prepare_dataset(str(tmp_path / "dataset"), tok, max_length=128, pack=False,
                             shuffle=False, verbose=False)
    assert len(packed) == 3
    for row, src in zip(packed, out):
        masked = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
        assert tok.decode(masked) == trained_text(src["messages"][1]["content"],
                                                  src["truncated_turns"] == [1])


def test_too_long_prompts_keep_their_answers_and_are_counted(tmp_path, train_target, capsys):
    """max_model_len 40: the long prompt is refused by the engine, so the whole conversation
    keeps its answers; the short one is regenerated. The summary line counts both."""
    cfg = RegenerateConfig(enabled=True, temperature=0.0, max_tokens=8, batch_size=2,
                           max_model_len=40)
    long = {"messages": [{"role": "user", "content": "x = 1\u2028\n" * 30},
                         {"role": "assistant", "content": "a"},
                         {"role": "user", "content": "y"}, {"role": "assistant", "content": "b"}]}
    short = {"messages": [{"role": "user", "content": "def f():"},
                          {"role": "assistant", "content": "pass"}]}
    out = regenerate(datasets.Dataset.from_list([long, short]), train_target, cfg, tmp_path,
                     device="cpu", progress=False)
    assert out[0] == {**long, "truncated_turns": []}
    assert out[1]["messages"][1]["content"] != "pass"
    line = capsys.readouterr().out
    assert re.search(r"regenerate: 1 answers .* [01] hit max_tokens=8, 2 kept", line), line


def test_template_kwargs_reach_the_prompts_and_the_fingerprint(tmp_path, train_target, calls):
    """enable_thinking=false renders the generation prompt the template gives for it, and a
    rerun into the same folder with another value is refused."""
    target = thinking_target(train_target, tmp_path / "target")
    rows = chat_rows(2, seed=3)
    regenerate(datasets.Dataset.from_list(rows), str(target), CFG, tmp_path / "run",
               device="cpu", progress=False, template_kwargs={"enable_thinking": False})
    tok = AutoTokenizer.from_pretrained(target)
    for prompt, row in zip(calls[0], rows):
        text = tok.decode(prompt)
        assert text.endswith("# no thinking\n") and text.startswith(
            tok.decode(rendered(tok, row["messages"][:1])))
    with pytest.raises(ValueError, match="template_kwargs"):
        regenerate(datasets.Dataset.from_list(rows), str(target), CFG, tmp_path / "run",
                   device="cpu", progress=False, template_kwargs={"enable_thinking": True})


@pytest.mark.vllm
@pytest.mark.skipif(not (os.environ.get("DRAFTSMITH_VLLM_PYTHON")
                         or importlib.util.find_spec("vllm")),
                    reason="no vLLM (set DRAFTSMITH_VLLM_PYTHON)")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_vllm_session_rewrites_the_same_greedy_answers(tmp_path, tmp_path_factory, arch):
    """regenerate.engine=vllm (one vLLM session for the whole rewrite) writes the greedy answers
    draftsmith's engine writes (transformers' generate for Gemma 3, which the engine does not
    run; its sliding window shorter than the answers), multi-turn conversations included (vLLM
    runs in the dtype draftsmith would: with vLLM's own "auto" this float32 target ran in 16
    bits and answers parted at the 8th token)."""
    from .conftest import save_train_target

    target = save_train_target(tmp_path_factory.mktemp("vllm_regen"), hidden=128,
                               arch=arch)  # head_dim 32 (vLLM's CPU attention refuses 16)
    rows = chat_rows(6, seed=3)
    rows[0]["messages"] += [{"role": "user", "content": "more"},
                            {"role": "assistant", "content": "x = 1\n"}]
    ds = datasets.Dataset.from_list(rows)
    ours = regenerate(ds, target, CFG, tmp_path / "ours", device="cpu", progress=False)
    cfg = RegenerateConfig(**{**vars(CFG), "engine": "vllm",
                              "vllm_python": os.environ.get("DRAFTSMITH_VLLM_PYTHON")})
    theirs = regenerate(ds, target, cfg, tmp_path / "vllm", device="cpu", progress=False)
    assert theirs.to_list() == ours.to_list()
    assert ours.to_list() != ds.to_list()  # answers were rewritten


def test_unset_max_model_len_is_what_training_keeps(tmp_path, train_target):
    """max_model_len unset: the engine gets ``context`` (the pipeline's data.max_length +
    max_tokens), so the long prompt is kept as with max_model_len 40; without a context the
    engine's own default applies, and a context beyond the target's positions is capped."""
    rows = [{"messages": [{"role": "user", "content": "x = 1\u2028\n" * 30},
                          {"role": "assistant", "content": "a"}]}]
    out = regenerate(datasets.Dataset.from_list(rows), train_target, CFG, tmp_path,
                     device="cpu", progress=False, context=40)
    assert out[0]["messages"][1]["content"] == "a"
    positions = Regenerator(train_target, CFG, 0, "cpu", context=10**6).llm.max_model_len
    assert positions == load_config(train_target).max_position_embeddings
    assert Regenerator(train_target, CFG, 0, "cpu", context=48).llm.max_model_len == 48


def test_regenerate_seed_lets_other_training_seeds_share_the_answers(tmp_path, train_target,
                                                                     calls):
    """The answers are keyed by regenerate.seed (unset: the run's seed), so a seed sweep trains
    every seed on one sampled set; a run whose seed keys other answers is told which to set."""
    from omegaconf import OmegaConf

    from train.pipeline import regenerated

    from .test_config import compose_train

    raw = datasets.Dataset.from_list(chat_rows(3, seed=4))

    def answers(*overrides):
        cfg = OmegaConf.to_object(compose_train([
            f"output_dir={tmp_path}", f"target.path={train_target}", "trainer.device=cpu",
            "regenerate.enabled=true", "regenerate.temperature=1.0", "regenerate.max_tokens=8",
            *overrides]))
        return regenerated(cfg, train_target, raw, "regenerated")["messages"]

    first = answers("seed=0", "regenerate.seed=7")
    rewrites = len(calls)
    assert rewrites > 0 and answers("seed=3", "regenerate.seed=7") == first
    assert len(calls) == rewrites  # reused, not rewritten
    saved = json.loads((tmp_path / "tiny_eagle3" / "regenerated" / "fingerprint.json").read_text())
    assert saved["seed"] == 7
    with pytest.raises(ValueError, match=r"'seed': its answers have 7, this run has 3.*"
                                         r"regenerate\.seed=7"):
        answers("seed=3")
