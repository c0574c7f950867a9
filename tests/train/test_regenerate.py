"""Regeneration: the target's own answers through the engine, turn by turn, resumable."""

import datasets
import pytest
from transformers import AutoTokenizer

from infer import LLM, SamplingParams
from train.config import RegenerateConfig
from train.data import prepare_dataset
from train.regenerate import Regenerator, regenerate

from .conftest import chat_rows

CFG = RegenerateConfig(enabled=True, temperature=0.0, max_tokens=6, batch_size=4)


def direct(target, history):
    """What the engine answers to ``history`` (the reference for the regenerated turn)."""
    tok = AutoTokenizer.from_pretrained(target)
    text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = LLM(target, device="cpu").generate([ids], SamplingParams(temperature=0.0, max_tokens=6))
    return out[0].outputs[0].text


def test_chat_answers_are_the_targets_and_prompts_unchanged(tmp_path, train_target):
    rows = chat_rows(3, seed=5)
    out = regenerate(datasets.Dataset.from_list(rows), train_target, CFG, tmp_path,
                     device="cpu", progress=False)
    assert len(out) == 3
    for row, new in zip(rows, out):
        user, answer = new["messages"]
        assert user == row["messages"][0]
        assert answer["role"] == "assistant" and answer["content"] != row["messages"][1]["content"]
        assert answer["content"] == direct(train_target, [user])


def test_multi_turn_conditions_on_the_regenerated_earlier_answer(tmp_path, train_target):
    conv = [{"role": "user", "content": "def add(a, b):"},
            {"role": "assistant", "content": "return a + b"},
            {"role": "user", "content": "for i in range(3):"},
            {"role": "assistant", "content": "print(i)"}]
    out = regenerate(datasets.Dataset.from_list([{"messages": conv}]), train_target, CFG,
                     tmp_path, device="cpu", progress=False)[0]["messages"]
    assert out[1]["content"] == direct(train_target, conv[:1])
    assert out[3]["content"] == direct(train_target, [conv[0], out[1], conv[2]])


def test_prompt_completion_rows(tmp_path, train_target):
    rows = [{"prompt": "class Point:", "completion": "pass"}]
    out = regenerate(datasets.Dataset.from_list(rows), train_target, CFG, tmp_path,
                     device="cpu", progress=False)[0]["messages"]
    assert out[0] == {"role": "user", "content": "class Point:"}
    assert out[1]["content"] == direct(train_target, out[:1])


def test_interrupted_run_resumes_with_the_missing_chunks(tmp_path, train_target, monkeypatch):
    ds = datasets.Dataset.from_list(chat_rows(6, seed=1))
    calls, interrupt = [], [True]
    real = Regenerator.chunk

    def failing(self, convs):
        calls.append(len(convs))
        if interrupt[0] and len(calls) == 2:
            raise RuntimeError("simulated interruption")
        return real(self, convs)

    monkeypatch.setattr(Regenerator, "chunk", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        regenerate(ds, train_target, CFG, tmp_path, device="cpu", progress=False, chunk_size=2)
    assert sorted(p.name for p in tmp_path.glob("chunk_*")) == ["chunk_00000.jsonl"]
    calls.clear()
    interrupt[0] = False
    resumed = regenerate(ds, train_target, CFG, tmp_path, device="cpu", progress=False,
                         chunk_size=2)
    assert calls == [2, 2]  # chunks 1 and 2 only
    monkeypatch.setattr(Regenerator, "chunk", real)
    fresh = regenerate(ds, train_target, CFG, tmp_path / "fresh", device="cpu", progress=False,
                       chunk_size=2)
    assert resumed.to_list() == fresh.to_list()


def test_changed_settings_are_named(tmp_path, train_target):
    ds = datasets.Dataset.from_list(chat_rows(2))
    regenerate(ds, train_target, CFG, tmp_path, device="cpu", progress=False)
    hotter = RegenerateConfig(enabled=True, temperature=0.7, max_tokens=6, batch_size=4)
    with pytest.raises(ValueError, match="temperature=0.0"):
        regenerate(ds, train_target, hotter, tmp_path, device="cpu", progress=False)


def test_text_rows_cannot_be_regenerated(tmp_path, train_target):
    with pytest.raises(ValueError, match="'text'"):
        regenerate(datasets.Dataset.from_list([{"text": "x = 1"}]), train_target, CFG, tmp_path)


def test_output_trains_with_assistant_only_masks(tmp_path, train_target):
    out = regenerate(datasets.Dataset.from_list(chat_rows(4)), train_target, CFG, tmp_path,
                     device="cpu", progress=False)
    tok = AutoTokenizer.from_pretrained(train_target)
    packed = prepare_dataset(out, tok, max_length=128, pack=False, shuffle=False, verbose=False)
    for row, src in zip(packed, out):
        masked = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
        answer = src["messages"][1]["content"]
        assert answer.strip() and tok.decode(masked).startswith(answer)
