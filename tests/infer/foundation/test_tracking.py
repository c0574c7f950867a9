"""Tracking: the logger factory, offline-mode resolution, and an offline W&B run read back."""

import json
from pathlib import Path

import pytest

from infer.metrics import SpecMetrics
from infer.foundation.tracking import (NoopLogger, WandbLogger, acceptance_scalars,
                                       has_wandb_api_key, make_logger, read_wandb_file,
                                       resolve_wandb_mode)


def test_make_logger_kinds_and_ranks(tmp_path):
    assert type(make_logger("none")) is NoopLogger
    assert type(make_logger("wandb", rank=1, dir=tmp_path)) is NoopLogger  # no run started
    assert not (tmp_path / "wandb").exists()
    with pytest.raises(ValueError, match="'logger'.*'tensorboard'.*wandb, none"):
        make_logger("tensorboard")
    noop = make_logger("none")
    noop.log({"a": 1}, step=0)
    noop.log_table("t", ["a"], [[1]])
    noop.log_image("i", "missing.png")
    assert noop.log_acceptance("eval/x", {"acceptance_length": 2.0}, step=0) == {
        "eval/x/acceptance_length": 2.0}
    noop.finish()


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.com login u password p\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    for key, sub in (("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"),
                     ("WANDB_CONFIG_DIR", "config")):  # keep W&B's own files out of $HOME
        monkeypatch.setenv(key, str(tmp_path / "wandb-home" / sub))
    return netrc


def test_mode_resolution(monkeypatch, no_credentials):
    assert not has_wandb_api_key() and resolve_wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")  # the environment wins over the key
    assert resolve_wandb_mode() == "offline"
    assert resolve_wandb_mode("disabled") == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY")
    no_credentials.write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    assert has_wandb_api_key() and resolve_wandb_mode() == "online"
    with pytest.raises(ValueError, match="'mode'"):
        resolve_wandb_mode("sometimes")


def test_acceptance_scalars_one_naming_for_all_sources():
    metrics = SpecMetrics()
    metrics.record(3, 2)
    metrics.record(3, 0)
    flat = acceptance_scalars("serve", metrics)
    assert flat["serve/acceptance_length"] == pytest.approx(2.0)
    assert flat["serve/acceptance_rate"] == pytest.approx(2 / 6)
    assert [flat[f"serve/per_position/{i}"] for i in range(3)] == pytest.approx([0.5, 0.5, 0])
    assert flat["serve/num_drafts"] == 2 and "serve/num_accepted_tokens_per_pos" not in flat
    row = {"method": "ngram", "acceptance_length": 1.5, "per_position": [0.4], "speedup": 1.2,
           "lossless": True, "predicted_speedup": float("nan")}
    assert acceptance_scalars("eval/ngram", row) == {
        "eval/ngram/acceptance_length": 1.5, "eval/ngram/per_position/0": 0.4,
        "eval/ngram/speedup": 1.2, "eval/ngram/lossless": 1.0}
    train = acceptance_scalars("train/ttt", {"per_position": [0.8, 0.6], "loss": 1.0})
    assert set(train) == {"train/ttt/per_position/0", "train/ttt/per_position/1",
                          "train/ttt/loss"}


def _report(tmp_path):
    """A two-row harness report (one greedy, one sampled row) with its plots written."""
    from dataclasses import fields

    from infer.eval.advisor import advise
    from infer.eval.harness import ConfigResult, HarnessReport
    from infer.eval.report import write_report

    rows = []
    for temp, lossless in ((0.0, True), (0.8, None)):
        values = {f.name: 1 for f in fields(ConfigResult)}
        values.update(method="ngram", speculative_config={"method": "ngram"}, k=2,
                      temperature=temp, per_position=[0.9, 0.6], num_accepted_tokens_per_pos=[9, 6],
                      acceptance_length=2.5, acceptance_rate=0.75, lossless=lossless,
                      mismatched_prompts=[])
        rows.append(ConfigResult(**values))
    advisor, recommended = advise(rows)
    report = HarnessReport("target", {"max_tokens": 8, "num_prompts": 1, "device": "cpu"}, [],
                           rows, advisor, recommended, "now")
    write_report(report, tmp_path / "eval")
    return report


def test_offline_wandb_run_contains_logged_keys(no_credentials, tmp_path):
    from infer.eval.report import log_report

    report = _report(tmp_path)
    logger = make_logger("wandb", rank=0, project="draftsmith-test", name="offline-check",
                         config={"k": 2}, dir=tmp_path / "run")
    assert isinstance(logger, WandbLogger) and logger.mode == "offline"
    logger.log({"train/loss": 1.5}, step=0)
    logger.log_acceptance("eval/ngram", report.results[0], step=1)  # what the harness logs
    log_report(report, logger, step=1)  # table (mixed lossless values), plots, recommended k
    files_dir = logger.dir
    logger.finish()
    logger.finish()  # idempotent

    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    data = read_wandb_file(runs[0])  # waits for W&B's service to finish writing the file
    assert data["complete"]
    assert data["summary"]["train/loss"] == 1.5
    assert data["summary"]["eval/ngram/per_position/1"] == 0.6
    steps: dict = {}
    for row in data["history"]:
        steps.setdefault(row["_step"], {}).update(row)
    assert steps[0]["train/loss"] == 1.5
    assert steps[1]["eval/ngram/acceptance_length"] == 2.5
    assert steps[1]["eval/ngram/acceptance_rate"] == 0.75
    assert steps[1]["eval/ngram/per_position/1"] == 0.6
    assert steps[1]["eval/recommended_k/ngram"] in (1, 2) and steps[1]["eval/lossless"] == 1.0
    assert steps[1]["eval/results/_type"] == "table-file" and steps[1]["eval/results/nrows"] == 2
    table = json.loads((Path(files_dir) / steps[1]["eval/results/path"]).read_text())
    lossless = table["columns"].index("lossless")
    assert [r[lossless] for r in table["data"]] == ["yes", "n/a"]
    for plot in ("per_position_acceptance", "speedup_vs_k", "acceptance_length_vs_k"):
        assert steps[1][f"eval/{plot}/_type"] == "image-file"
        assert (Path(files_dir) / steps[1][f"eval/{plot}/path"]).stat().st_size > 1000
