"""Acceptance harness: metrics against hand-computed values on a scripted proposer, the k
advisor on synthetic costs, the lossless check, the outputs (JSON keys, markdown, PNGs), prompt
loading, and ``python infer.py mode=eval``'s code path."""

import json
import logging
import random
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from infer.eval.advisor import advise, advise_k, advise_schedule, draft_cost_at, verify_cost_at
from infer.engine import LLM
from infer.eval.harness import (ConfigResult, HarnessConfig, HarnessReport, expand_matrix,
                           load_prompts, prompt_from_record, run_harness)
from infer.eval.methods import with_paired_draft
from infer.eval.options import HarnessOptions
from infer.eval.report import PLOTS
from infer.proposers import base
from infer.proposers.base import Proposal, Proposer, pad_drafts
from infer.sampling import SamplingParams
from infer.spec_config import SpeculativeConfig
from infer.foundation.tracking import NoopLogger

VOCAB = 96  # tests/infer/conftest.py save_tiny_llama
MAX_TOKENS = 12
SCRIPTED = "scripted/medusa"  # a hub-id-shaped model name: never read (ScriptedProposer)
PROMPTS = [[random.Random(i).randrange(VOCAB) for _ in range(5 + i)] for i in range(3)]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and far faster than two threads on a busy
    2-core machine (OpenMP workers spin against the other processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class ScriptedProposer(Proposer):
    """Drafts the target's own greedy continuation for the first ``correct`` positions, then a
    token that is certainly wrong. ``references`` maps a prompt to its greedy output."""

    correct = 2
    references: dict = {}

    def __init__(self, spec, ctx):
        super().__init__(spec, ctx)
        self.prompts = {}

    def start(self, slot, prompt_ids):
        self.prompts[slot] = tuple(prompt_ids)

    def propose(self, batch):
        drafts = []
        for slot, tokens in zip(batch.slots, batch.token_ids):
            prompt = self.prompts[slot]
            ref, n = self.references[prompt], len(tokens) - len(prompt)  # n outputs so far
            row = []
            for i in range(batch.k):
                right = ref[n + i] if n + i < len(ref) else 0
                row.append(right if i < self.correct else (right + 1) % VOCAB)
            drafts.append(row)
        return Proposal(pad_drafts(drafts, batch.k, self.ctx.device))


@pytest.fixture
def scripted(monkeypatch, tiny_target):
    """Registers ScriptedProposer as method "medusa" (a schema-valid method name this engine does
    not serve; its ``model`` is never loaded) in a copy of the registry, with greedy references from autoregressive decoding."""
    base.PROPOSERS.load_all()
    monkeypatch.setattr(base.PROPOSERS, "_classes", dict(base.PROPOSERS._classes))
    base.PROPOSERS.unregister("medusa")
    base.PROPOSERS.register("medusa")(ScriptedProposer)
    llm = LLM(tiny_target, max_num_seqs=4, device="cpu")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    monkeypatch.setattr(ScriptedProposer, "references",
                        {tuple(p): o.token_ids for p, o in zip(PROMPTS, outs)})
    monkeypatch.setattr(ScriptedProposer, "correct", 2)
    return ScriptedProposer


class RecordingLogger(NoopLogger):
    def __init__(self):
        self.scalars, self.tables, self.images = {}, {}, {}

    def log(self, data, step=None):
        self.scalars.update(data)

    def log_table(self, name, columns, rows, step=None):
        self.tables[name] = (list(columns), [list(r) for r in rows])

    def log_image(self, name, path, step=None, caption=None):
        self.images[name] = str(path)


def test_scripted_metrics_outputs_and_logging(scripted, tiny_target, tmp_path):
    # Per request (max_tokens 12, k 3, 2 right drafts then a wrong one): the prefill emits token
    # 1; steps draft 3, 3, 3 and then 1 (only 12 - 10 - 1 = 1 fits), accepting 2, 2, 2, 1 and
    # emitting 3, 3, 3, 2 tokens. So 4 drafts, 10 draft tokens, 7 accepted, position counts
    # [4, 3, 0]: acceptance length 1 + 7/4, rate 7/10, per-position [1, 3/4, 0].
    logger = RecordingLogger()
    configs = expand_matrix([{"name": "scripted", "method": "medusa", "model": SCRIPTED}], ks=[3], batch_sizes=[1, 2])
    report = run_harness(tiny_target, configs, PROMPTS,
                         HarnessOptions(max_tokens=MAX_TOKENS, device="cpu"), output_dir=tmp_path,
                         logger=logger)
    n = len(PROMPTS)
    assert [(r.method, r.k, r.batch_size) for r in report.results] == [("scripted", 3, 1),
                                                                         ("scripted", 3, 2)]
    for row in report.results:
        assert (row.num_drafts, row.num_draft_tokens, row.num_accepted_tokens) == \
            (4 * n, 10 * n, 7 * n)
        assert row.num_accepted_tokens_per_pos == [4 * n, 3 * n, 0]
        assert row.acceptance_length == pytest.approx(2.75)
        assert row.acceptance_rate == pytest.approx(0.7)
        assert row.per_position == pytest.approx([1.0, 0.75, 0.0])
        assert row.draft_coverage == pytest.approx(1.0)  # every step drafted
        assert row.tokens_per_step == pytest.approx(11 / 4)  # 11 step tokens in 4 steps
        assert row.steps >= 4 and row.tokens == n * MAX_TOKENS
        assert row.lossless is True and row.mismatched_prompts == []
        assert row.cost_draft > 0 and row.cost_verify > 0 and row.speedup > 0
        assert row.predicted_speedup == pytest.approx(
            2.75 / (row.cost_draft + row.cost_verify))
    assert {(b.batch_size, b.temperature) for b in report.baselines} == {(1, 0.0), (2, 0.0)}
    assert report.lossless and set(report.recommended_k) == {"scripted"}
    assert [a["recommended_k"] in (1, 2, 3) for a in report.advisor] == [True, True]

    data = json.loads((tmp_path / "results.json").read_text())
    assert {"schema_version", "created", "target", "settings", "baselines", "results",
            "advisor", "recommended_k", "lossless", "files"} <= set(data)
    row_keys = {f.name for f in fields(ConfigResult)}
    assert {"method", "k", "temperature", "batch_size", "acceptance_length", "acceptance_rate",
            "per_position", "tok_s", "speedup", "predicted_speedup", "lossless", "cost_draft",
            "cost_verify"} <= row_keys
    assert all(set(r) == row_keys for r in data["results"])
    assert data["results"][0]["per_position"] == pytest.approx([1.0, 0.75, 0.0])
    assert data["recommended_k"] == report.recommended_k and data["lossless"] is True
    assert HarnessReport.from_dict(data).to_dict() == data  # the schema round-trips
    assert {"method", "batch_size", "temperature", "measured_ks", "recommended_k",
            "predicted_speedup", "candidates"} <= set(data["advisor"][0])
    assert {"batch_size", "temperature", "tok_s", "c_ar_s"} <= set(data["baselines"][0])
    for name in PLOTS:
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    md = (tmp_path / "results.md").read_text()
    assert "| scripted | 3 | 0 | 1 | greedy | 2.75 | 0.700 | 1.00 0.75 0.00 |" in md
    assert "LOSSLESS CHECK FAILED" not in md
    assert not list(tmp_path.glob(".*"))  # no temporary files left behind

    assert logger.scalars["eval/scripted/k3/T0/b2/acceptance_length"] == pytest.approx(2.75)
    assert logger.scalars["eval/scripted/k3/T0/b1/per_position/1"] == pytest.approx(0.75)
    assert logger.scalars["eval/lossless"] == 1.0
    assert "eval/recommended_k/scripted" in logger.scalars
    columns, rows = logger.tables["eval/results"]
    assert columns[:4] == ["method", "k", "temperature", "batch_size"] and len(rows) == 2
    assert set(logger.images) == {f"eval/{name[:-4]}" for name in PLOTS}


def test_lossless_mismatch_is_reported(scripted, tiny_target, tmp_path, caplog):
    # synthetic acceptance at rate 1 accepts every draft, and every draft here is wrong
    scripted.correct = 0
    spec = {"name": "broken", "method": "medusa", "model": SCRIPTED, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rate": 1.0}
    with caplog.at_level(logging.ERROR, logger="infer.eval.harness"):
        report = run_harness(tiny_target, expand_matrix([spec], [2], temperatures=[0.0, 1.0]),
                             PROMPTS, HarnessOptions(max_tokens=6, warmup=False, device="cpu"),
                             output_dir=tmp_path)
    greedy, sampled = report.results
    assert greedy.lossless is False and greedy.mismatched_prompts == [0, 1, 2]
    assert greedy.acceptance_rate == 1.0
    assert sampled.lossless is None  # sampled rows are not compared
    assert not report.lossless
    assert "LOSSLESS CHECK FAILED" in caplog.text and "broken k=2" in caplog.text
    assert json.loads((tmp_path / "results.json").read_text())["lossless"] is False
    md = (tmp_path / "results.md").read_text()
    assert "**LOSSLESS CHECK FAILED**" in md and "**NO - MISMATCH**" in md
    assert "n/a (sampled)" in md


# ---- the k advisor (pure functions) ------------------------------------------------------------

def test_advise_k_one_measured_k():
    # per-token draft cost 0.5 / 5 = 0.1, verify 1.2 constant:
    # k=1 1.9/1.3=1.462, k=2 2.6/1.4=1.857, k=3 3.1/1.5=2.067, k=4 3.3/1.6=2.062, k=5 3.4/1.7=2
    rates = [0.9, 0.7, 0.5, 0.2, 0.1]
    advice = advise_k(rates, {5: (0.5, 1.2)})
    assert advice["recommended_k"] == 3
    assert advice["predicted_speedup"] == pytest.approx(3.1 / 1.5)
    speedups = [c["predicted_speedup"] for c in advice["candidates"]]
    assert speedups == pytest.approx([1.9 / 1.3, 2.6 / 1.4, 3.1 / 1.5, 3.3 / 1.6, 3.4 / 1.7])
    assert [c["cost_draft"] for c in advice["candidates"]] == pytest.approx(
        [0.1, 0.2, 0.3, 0.4, 0.5])
    # nearly free drafting (0.01 per token): the deepest k, 3.4 / 1.05
    assert advise_k(rates, {5: (0.05, 1.0)})["recommended_k"] == 5
    # half the steps draft nothing (n-gram without a match): E[acc|k] halves, so
    # k=1 1.45/1.3=1.115, k=2 1.8/1.4=1.286, k=3 2.05/1.5=1.367, k=4 2.15/1.6=1.344
    half = advise_k(rates, {5: (0.5, 1.2)}, coverage=0.5)
    assert half["candidates"][0]["expected_accepted"] == pytest.approx(0.45)
    assert half["recommended_k"] == 3
    assert half["predicted_speedup"] == pytest.approx(2.05 / 1.5)


def test_advise_k_interpolates_between_measured_ks():
    costs = {1: (0.2, 1.0), 3: (0.6, 1.4)}
    assert draft_cost_at(2, costs) == pytest.approx(0.4)
    assert verify_cost_at(2, costs) == pytest.approx(1.2)
    assert verify_cost_at(5, costs) == pytest.approx(1.4)  # constant outside
    assert draft_cost_at(5, costs) == pytest.approx(1.0)  # last segment's slope
    # k=1 1.8/1.2=1.5, k=2 2.5/1.6=1.5625, k=3 2.8/2.0=1.4
    advice = advise_k([0.8, 0.7, 0.3], costs)
    assert advice["recommended_k"] == 2
    assert advice["predicted_speedup"] == pytest.approx(2.5 / 1.6)


def _row(method, k, batch, per_position, cost_draft, cost_verify):
    values = {f.name: 0 for f in fields(ConfigResult)}
    values.update(method=method, k=k, batch_size=batch, temperature=0.0,
                  per_position=per_position, cost_draft=cost_draft, cost_verify=cost_verify,
                  draft_coverage=1.0, lossless=True)
    return ConfigResult(**values)


def test_advise_groups_and_recommends_per_method():
    rates = [0.9, 0.7, 0.5, 0.2, 0.1]
    rows = [_row("m", 5, 1, rates, 0.5, 1.2),  # alone: k=3 (see above)
            _row("m", 5, 8, rates, 0.5, 0.2)]  # alone: k=2 (2.6/0.4 = 6.5)
    records, recommended = advise(rows)
    assert [(r["batch_size"], r["recommended_k"]) for r in records] == [(1, 3), (8, 2)]
    # geometric mean over both groups (products): k=1 1.462*6.333=9.26, k=2 1.857*6.5=12.07,
    # k=3 2.067*6.2=12.81, k=4 2.062*5.5=11.34, k=5 2.0*4.857=9.71
    assert recommended == {"m": 3}


def test_the_advisor_writes_a_k_by_batch_size_schedule_that_the_schema_takes():
    """Per measured batch size its best k, 0 where drafting is predicted to lose; ranges up to
    the next measured batch size, the first from 1; a method at one batch size gets none."""
    rates = [0.9, 0.7, 0.5, 0.2, 0.1]
    rows = [_row("m", 5, 1, rates, 0.5, 1.2),  # k=3 best
            _row("m", 5, 4, rates, 0.5, 0.2),  # k=2 best
            _row("m", 5, 16, [0.1, 0.05, 0, 0, 0], 1.0, 2.0),  # every k predicted < 1
            _row("alone", 5, 1, rates, 0.5, 1.2)]
    records, _ = advise(rows)
    schedule = advise_schedule(records)
    assert schedule == {"m": [[1, 3, 3], [4, 15, 2], [16, 16, 0]]}
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 5,
                                    "num_speculative_tokens_per_batch_size": schedule["m"]})
    assert [spec.k_for_batch(b) for b in (1, 3, 4, 15, 16, 64)] == [3, 3, 2, 2, 0, 0]


# ---- the matrix ----------------------------------------------------------------------------

def test_expand_matrix_labels_and_errors():
    cfgs = expand_matrix([{"method": "ngram"}, {"name": "pard", "method": "draft_model",
                                                 "model": "x", "parallel_drafting": True}],
                         ks=[1, 3], temperatures=[0.0, 0.7], batch_sizes=[4])
    assert len(cfgs) == 8 and cfgs[0] == HarnessConfig({"method": "ngram"}, 1, 0.0, 4, "ngram")
    assert {c.method for c in cfgs} == {"ngram", "pard"}
    assert cfgs[4].spec().num_speculative_tokens == 1 and cfgs[4].spec().parallel_drafting
    with pytest.raises(ValueError, match="unique labels"):
        expand_matrix([{"method": "ngram"}, {"method": "ngram", "prompt_lookup_max": 3}], [1])
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        expand_matrix([{"method": "ngram", "num_speculative_tokens": 3}], [1])
    with pytest.raises(ValueError, match="'k'"):
        HarnessConfig({"method": "ngram"}, 0)


def test_expand_matrix_takes_a_method_s_own_ks():
    """A method's ``ks`` replaces the matrix's for it (a reference row measured at one k)."""
    cfgs = expand_matrix([{"method": "ngram"}, {"method": "suffix", "ks": [3]}], ks=[1, 3, 5],
                         temperatures=[0.0, 1.0])
    assert [(c.method, c.k) for c in cfgs if c.temperature == 0.0] == [
        ("ngram", 1), ("ngram", 3), ("ngram", 5), ("suffix", 3)]
    assert all("ks" not in c.speculative_config for c in cfgs)
    for bad in ([], [0], "3", [True], 3):
        with pytest.raises(ValueError, match=r"methods\[1\]\.ks"):
            expand_matrix([{"method": "ngram"}, {"method": "suffix", "ks": bad}], ks=[1])


def test_expand_matrix_takes_a_method_s_own_temperatures_and_batch_sizes():
    """A tree row measured where trees apply (greedy, batch 1) beside the whole matrix."""
    cfgs = expand_matrix([{"method": "ngram"}, {"method": "suffix", "name": "s1",
                                                "temperatures": [0], "batch_sizes": [1]}],
                         ks=[3], temperatures=[0.0, 1.0], batch_sizes=[1, 8])
    assert [(c.method, c.temperature, c.batch_size) for c in cfgs] == [
        ("ngram", 0.0, 1), ("ngram", 0.0, 8), ("ngram", 1.0, 1), ("ngram", 1.0, 8),
        ("s1", 0.0, 1)]
    assert all(not {"temperatures", "batch_sizes"} & c.speculative_config.keys() for c in cfgs)
    for key, bad in (("temperatures", [-1.0]), ("temperatures", []), ("batch_sizes", [0])):
        with pytest.raises(ValueError, match=rf"methods\[0\]\.{key}"):
            expand_matrix([{"method": "ngram", key: bad}], ks=[1])


# ---- prompt sets ----------------------------------------------------------------------------

class ChatTokenizer:
    chat_template = "stub"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_prompt_shapes():
    assert prompt_from_record({"prompt": "def f():"}) == ("def f():", False)  # HumanEval
    assert prompt_from_record({"question": "2+2?", "answer": "4"}) == (
        [{"role": "user", "content": "2+2?"}], True)  # GSM8K
    assert prompt_from_record({"turns": ["first", "second"]})[0] == [
        {"role": "user", "content": "first"}]  # MT-bench
    sharegpt = {"conversations": [{"from": "system", "value": "be brief"},
                                  {"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]}
    assert prompt_from_record(sharegpt)[0] == [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "hi"}]
    openai = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant",
                                                              "content": "b"}]}
    assert prompt_from_record(openai) == ([{"role": "user", "content": "a"}], True)
    assert prompt_from_record({"prompt_token_ids": [1, 2]}) == ([1, 2], False)
    with pytest.raises(ValueError, match="no prompt field"):
        prompt_from_record({"answer": "4"})


def test_load_prompts_local_files(tmp_path):
    records = [{"prompt": "def f():"}, {"question": "2+2?"}, {"turns": ["hello"]},
               {"messages": [{"role": "user", "content": "hey"}]}]
    jsonl = tmp_path / "set.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    tok = ChatTokenizer()
    assert load_prompts(str(jsonl), tokenizer=tok) == [
        "def f():", "<user>2+2?<assistant>", "<user>hello<assistant>", "<user>hey<assistant>"]
    assert load_prompts(str(jsonl), tokenizer=tok, chat=False, num=2) == ["def f():", "2+2?"]
    assert load_prompts(str(jsonl), tokenizer=tok, chat=True, num=1) == [
        "<user>def f():<assistant>"]
    assert load_prompts(str(jsonl))[1] == "2+2?"  # no tokenizer / template: plain text
    as_json = tmp_path / "set.json"
    as_json.write_text(json.dumps({"test": records[:2]}))
    assert load_prompts(str(as_json)) == ["def f():", "2+2?"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"answer": 1}\n')
    with pytest.raises(ValueError, match="record 0: record has no prompt field"):
        load_prompts(str(bad))


# ---- python infer.py mode=eval --------------------------------------------------------------

def test_infer_mode_eval(tiny_target, tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from infer.cli import check_mode, eval_prompts, run_eval
    from infer.config import register_configs

    register_configs()
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in PROMPTS))
    conf_dir = str((Path(__file__).parents[3] / "conf").resolve())
    with initialize_config_dir(config_dir=conf_dir, version_base=None):
        dcfg = compose("infer", overrides=[
            "mode=eval", f"model={tiny_target}", "device=cpu", f"eval.dataset={data}",
            "eval.methods=[{method: ngram, prompt_lookup_min: 1}]", "eval.ks=[2]",
            "eval.max_tokens=8", "eval.num_prompts=2", "eval.requests_per_slot=1",
            f"eval.output_dir={tmp_path / 'out'}"])
    cfg = OmegaConf.to_object(dcfg)
    assert check_mode(cfg) == "eval" and cfg.eval.logger == "none"
    prompts = eval_prompts(cfg, cfg.model, None)
    assert prompts == PROMPTS  # batch 8 wants 8 requests: the whole (short) set
    report = run_eval(cfg, cfg.model, prompts)
    served = {(r.batch_size, r.temperature): r.num_prompts for r in report.results}
    assert served == {(1, 0.0): 2, (1, 1.0): 2, (8, 0.0): 3, (8, 1.0): 3}
    greedy = [r for r in report.results if r.temperature == 0.0]
    assert all(r.method == "ngram" and r.lossless is True for r in greedy)
    assert json.loads((tmp_path / "out" / "results.json").read_text())["settings"][
        "num_prompts"] == 2
    cfg.mode = "train"
    with pytest.raises(ValueError, match="'mode'"):
        check_mode(cfg)
    assert with_paired_draft([{"method": "draft_model"}, {"method": "ngram"}], "d") == [
        {"method": "draft_model", "model": "d"}, {"method": "ngram"}]
    assert with_paired_draft([{"method": "draft_model"}, {"method": "ngram"}], None) == [
        {"method": "ngram"}]  # no draft LM paired with the target: the row is left out


def test_harness_loads_the_target_once(tiny_target, monkeypatch):
    """Every configuration and baseline forks one loaded engine (``LLM.with_config``)."""
    import infer.target

    loads = []
    real = infer.target.load_model
    monkeypatch.setattr(infer.target, "load_model",
                        lambda *a, **k: loads.append(a) or real(*a, **k))
    report = run_harness(tiny_target,
                         expand_matrix([{"method": "ngram", "prompt_lookup_min": 1}], [1, 2],
                                       batch_sizes=[1, 2]),
                         PROMPTS, HarnessOptions(max_tokens=4, warmup=False, device="cpu"))
    assert len(report.results) == 4 and len(report.baselines) == 2
    assert len(loads) == 1


def test_batch_runs_take_requests_per_slot(tiny_target, caplog):
    """A batch-B run serves max(num_prompts, requests_per_slot x B) prompts (its baseline the
    same ones); a prompt set too short for that is used whole, with a warning."""
    from infer.eval.report import render_markdown

    many = PROMPTS * 2  # six prompts (repeats are fine for ngram's acceptance here)
    with caplog.at_level(logging.WARNING):
        matrix = expand_matrix([{"method": "ngram"}], [2], batch_sizes=[1, 2, 4])
        report = run_harness(tiny_target, matrix, many,
                             HarnessOptions(max_tokens=4, warmup=False, num_prompts=1,
                                            requests_per_slot=2, device="cpu"))
    served = {r.batch_size: r.num_prompts for r in report.results}
    assert served == {1: 2, 2: 4, 4: 6}  # batch 4 wants 8: the set has 6
    assert {b.batch_size: b.num_prompts for b in report.baselines} == served
    assert not any(r.mismatched_prompts for r in report.results)
    assert "batch 4: 2 requests per slot want 8 prompts, the prompt set has 6" in caplog.text
    assert "batch 2" not in caplog.text
    assert report.settings["num_prompts"] == 1 and report.settings["requests_per_slot"] == 2
    assert "2 prompts at batch 1, 4 at batch 2, 6 at batch 4" in render_markdown(report)
    assert '"num_speculative_tokens_per_batch_size": [[1, 1, ' in render_markdown(report)
    whole = run_harness(tiny_target, expand_matrix([{"method": "ngram"}], [2], batch_sizes=[2]),
                        PROMPTS, HarnessOptions(max_tokens=4, warmup=False, device="cpu"))
    # defaults: every prompt at every batch size
    assert [r.num_prompts for r in whole.results] == [len(PROMPTS)]


def test_repeats_run_the_cell_in_rounds(tiny_target, monkeypatch):
    """repeats=3: three rounds of the cell, each every configuration once (the order shifts)
    then an autoregressive run; the row's speedup is the median of its three rounds."""
    import statistics

    from infer.eval import harness
    from infer.eval.report import render_markdown

    order = []
    real = harness._measure
    monkeypatch.setattr(harness, "_measure", lambda engine, spec, *a: order.append(
        spec.num_speculative_tokens if spec else 0) or real(engine, spec, *a))
    matrix = expand_matrix([{"method": "ngram"}], [1, 2], batch_sizes=[1])
    report = run_harness(tiny_target, matrix, PROMPTS,
                         HarnessOptions(max_tokens=4, warmup=False, repeats=3, device="cpu"))
    # the opening baseline (k 0), then per round both configurations and a baseline; the third
    # round starts at the second configuration
    assert order == [0, 1, 2, 0, 1, 2, 0, 2, 1, 0]
    for row in report.results:
        assert len(row.speedup_runs) == 3 and all(r > 0 for r in row.speedup_runs)
        assert row.speedup == statistics.median(row.speedup_runs)
    assert report.settings["repeats"] == 3
    assert "medians of 3 rounds" in render_markdown(report)
    single = run_harness(tiny_target, expand_matrix([{"method": "ngram"}], [1], batch_sizes=[1]),
                         PROMPTS, HarnessOptions(max_tokens=4, warmup=False, device="cpu"))
    assert single.results[0].speedup_runs == [] and "rounds" not in render_markdown(single)


def test_cells_run_back_to_back_between_two_baselines(tiny_target, monkeypatch):
    """A cell's configurations run one after the other (whatever the order they were given
    in), between an autoregressive run before and one after; each row's ar_tok_s is the two
    runs' throughput interpolated to its own run, so it lies between them."""
    from infer.eval import harness

    order = []
    real = harness._measure
    monkeypatch.setattr(harness, "_measure", lambda engine, spec, prompts, params, batch, *a: (
        order.append((batch, spec is not None)) or real(engine, spec, prompts, params, batch, *a)))
    report = run_harness(tiny_target,
                         expand_matrix([{"method": "ngram"}, {"method": "suffix"}], [2],
                                       batch_sizes=[1, 2]),
                         PROMPTS, HarnessOptions(max_tokens=4, warmup=False, device="cpu"))
    assert order == [(1, False), (1, True), (1, True), (1, False),
                     (2, False), (2, True), (2, True), (2, False)]
    assert [(r.method, r.batch_size) for r in report.results] == [  # the matrix's order
        ("ngram", 1), ("ngram", 2), ("suffix", 1), ("suffix", 2)]
    for row in report.results:
        base = next(b for b in report.baselines if b.batch_size == row.batch_size)
        assert base.tok_s_after > 0
        low, high = sorted([base.tok_s, base.tok_s_after])
        assert low <= row.ar_tok_s <= high
        assert row.speedup == pytest.approx(row.tok_s / row.ar_tok_s)


def test_baseline_interpolates_to_the_middle_of_a_run():
    """Linear in time between the run before (100 tok/s, 2 ms a step) and after (80, 2.5 ms),
    held at the ends."""
    from infer.eval.harness import _baseline, _baseline_at, _Run
    from infer.eval.machine import CpuWindow
    from infer.metrics import SpecMetrics

    def run(tok_s: float, at: float) -> _Run:
        return _Run([[1]] * 4, SpecMetrics(), int(tok_s), 1.0, 0, None, "cpu",
                    CpuWindow(1.0, 0.0, None), at)

    before, after = run(100, 10.0), run(80, 20.0)
    base = _baseline(before, after, 1, 0.0)
    base.c_ar_s, base.c_ar_s_after = 0.002, 0.0025
    assert (base.tok_s, base.tok_s_after) == (100, 80)
    mid = _baseline_at(base, before, after, 15.0)
    assert mid.tok_s == pytest.approx(90) and mid.c_ar_s == pytest.approx(0.00225)
    assert _baseline_at(base, before, after, 12.5).tok_s == pytest.approx(95)
    assert _baseline_at(base, before, after, 99.0).tok_s == pytest.approx(80)  # held
    assert base.tok_s == 100  # the cell's record is unchanged


def test_a_cell_whose_machine_changed_speed_is_flagged():
    """The run after a cell's first round 30 % faster than the one before (a shared host's
    neighbours): the report says so, names the cell, and advises repeats; a 5 % move and a cell
    without a run after are not flagged."""
    from infer.eval.report import render_markdown
    from infer.eval.results import Baseline, HarnessReport

    def base(batch: int, before: float, after: float) -> Baseline:
        return Baseline(batch, 0.0, before, 64, 64 / before, 64, 1 / before, tok_s_after=after)

    fast, steady, unknown = base(1, 300.0, 390.0), base(8, 1000.0, 950.0), base(4, 500.0, 0.0)
    assert fast.drift == pytest.approx(0.3) and fast.drifted
    assert steady.drift == pytest.approx(-0.05) and not steady.drifted
    assert unknown.drift is None and not unknown.drifted
    settings = {"max_tokens": 4, "num_prompts": 2, "device": "cpu", "torch_threads": 1}
    report = HarnessReport("t", dict(settings), [fast, steady, unknown], [], [], {}, "now")
    text = render_markdown(report)
    assert "speed drifted** within 1 cell(s)" in text
    assert "batch 1 T=0: 300.0 -> 390.0 tok/s" in text and "batch 8" not in text.split("##")[0]
    assert "eval.repeats=3" in text
    report.settings["repeats"] = 3
    assert "medians over the rounds damp it" in render_markdown(report)
    report.baselines = [steady, unknown]
    assert "drifted" not in render_markdown(report)


def test_warm_up_outputs_do_not_feed_timed_drafts(tiny_target, monkeypatch):
    """The warm-up's requests leave nothing in cross-request proposer state (suffix decoding's
    global tree) for the timed run to draft from."""
    seen = []
    generate = LLM.generate

    def recording(self, *args, **kwargs):
        if self.proposer is not None:
            seen.append(len(self.proposer.global_trie.seqs))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "generate", recording)
    run_harness(tiny_target, expand_matrix([{"method": "suffix"}], [2], batch_sizes=[1]), PROMPTS,
                HarnessOptions(max_tokens=4, device="cpu"))
    assert seen == [0, 0]  # warm-up, then the timed run: both from an empty global tree


def test_sampled_rows_draft_by_sampling_unless_told():
    head = {"method": "eagle3", "model": "some/eagle3-head"}
    assert HarnessConfig(head, 3, temperature=1.0).spec().draft_sample_method == "probabilistic"
    assert HarnessConfig(head, 3, temperature=1.0).spec().rejection_sample_method == \
        "probabilistic"
    assert HarnessConfig(head, 3).spec().draft_sample_method == "greedy"  # greedy rows
    strict = {**head, "rejection_sample_method": "strict"}
    assert HarnessConfig(strict, 3, temperature=1.0).spec().draft_sample_method == "greedy"
    ngram = HarnessConfig({"method": "ngram"}, 3, temperature=1.0).spec()
    assert ngram.draft_sample_method == "greedy"  # nothing to sample from
    other_vocab = {"method": "draft_model", "model": "some/draft", "use_heterogeneous_vocab": True}
    spec = HarnessConfig(other_vocab, 3, temperature=1.0).spec()  # greedy drafts only
    assert (spec.draft_sample_method, spec.rejection_sample_method) == ("greedy", "strict")
