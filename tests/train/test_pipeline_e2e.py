"""``python train.py`` end to end on a tiny in-process target: data -> features -> trainer ->
deployment checkpoint -> acceptance report, for each method and both feature modes."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from infer import LLM, SamplingParams
from infer.spec_config import SpeculativeConfig
from train.config import TrainConfig
from train.pipeline import run

from .test_config import compose_train
from .conftest import chat_rows


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in chat_rows(48, seed=3)))
    return str(path)


def make_cfg(tmp_path, target, data, *overrides) -> TrainConfig:
    base = [f"output_dir={tmp_path}", f"target.path={target}", f"data.source={data}",
            "data.max_length=128", "trainer.max_steps=4",
            "trainer.micro_batch_size=2", "trainer.device=cpu", "logger.kind=none",
            "eval.num_prompts=2", "eval.max_tokens=8", "eval.ks=[2]", "eval.dataset=" + data,
            "eval.dataset_split=train"]
    cfg = OmegaConf.to_object(compose_train(base + list(overrides)))
    if hasattr(cfg.drafter, "draft_vocab_size"):  # the methods with a draft vocabulary
        cfg.drafter.draft_vocab_size = 128
    return cfg


def greedy_lossless(target, spec, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    plain = LLM(target).generate(prompts, params)
    spec_out = LLM(target, speculative_config=spec).generate(prompts, params)
    return [o.token_ids for o in plain] == [o.token_ids for o in spec_out]


@pytest.mark.slow
@pytest.mark.parametrize("recipe,extra", [
    ("tiny_eagle3", ["objective.ttt_steps=2", "features.mode=online"]),
    ("tiny_eagle3", ["objective.ttt_steps=2", "features.mode=offline",
                     "features.dtype=float32", "features.rows_per_shard=4",
                     "eval.every_steps=2"]),
    ("tiny_eagle", ["objective.ttt_steps=1"]),
])
def test_eagle_recipes_end_to_end(tmp_path, train_target, chat_file, recipe, extra, capsys):
    cfg = make_cfg(tmp_path, train_target, chat_file, f"recipe={recipe}", *extra)
    final = run(cfg).final_dir
    out = capsys.readouterr().out.splitlines()
    served = [line for line in out if line.startswith("served[")]
    assert final == tmp_path / recipe / "final"
    config = json.loads((final / "config.json").read_text())
    report = json.loads((tmp_path / recipe / "eval" / "results.json").read_text())
    assert {r["method"] for r in report["results"]} == {recipe, "ngram", "suffix"}  # no paired
    assert {(r["temperature"], r["batch_size"]) for r in report["results"]} == {  # draft LM
        (0.0, 1), (0.0, 8), (1.0, 1), (1.0, 8)}
    assert {r["draft_sample_method"] for r in report["results"] if r["method"] == recipe
            and r["temperature"] > 0} == {"probabilistic"}  # sampled rows: sampled drafts
    assert report["lossless"] is True
    if "eval.every_steps=2" in extra:  # served acceptance at steps 2 and 4; the last one is
        assert [line.split(":")[0] for line in served] == [  # the final report's measurement
            "served[main step 2]", "served[main step 4]"]
        final_al = next(r["acceptance_length"] for r in report["results"]
                        if r["method"] == recipe and r["temperature"] == 0.0)
        assert f"acceptance length {final_al:.3f}" in served[-1], (served, final_al)
    else:
        assert not served
    method = "eagle3" if recipe == "tiny_eagle3" else "eagle"
    if method == "eagle3":
        assert config["speculators_model_type"] == "eagle3"
        assert "vLLM: this head needs vLLM >= 0.18.0" in out  # said before training (id n)
    assert greedy_lossless(train_target, {"method": method, "model": str(final),
                                          "num_speculative_tokens": 3}, [[5, 6, 7, 8]])


@pytest.mark.slow
@pytest.mark.parametrize("recipe, extra, kind", [
    ("tiny_peagle", ["objective.parallel_depths=3"], "peagle"),
    ("tiny_dflash", ["objective.block_size=4", "objective.max_anchors=8"], "dflash"),
    ("tiny_dspark", ["objective.block_size=4", "objective.max_anchors=8"], "dspark"),
])
def test_one_forward_recipes_end_to_end(tmp_path, train_target, chat_file, recipe, extra, kind):
    """P-EAGLE, DFlash and DSpark through the whole pipeline: trained, exported as their
    speculators type, evaluated losslessly, and served from the checkpoint alone (the schema
    infers eagle3 + parallel_drafting / dflash / dspark and k from it)."""
    cfg = make_cfg(tmp_path, train_target, chat_file, f"recipe={recipe}", *extra)
    final = run(cfg).final_dir
    config = json.loads((final / "config.json").read_text())
    assert config["speculators_model_type"] == kind
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    report = json.loads((tmp_path / recipe / "eval" / "results.json").read_text())
    assert recipe in {r["method"] for r in report["results"]} and report["lossless"] is True
    spec = SpeculativeConfig.parse({"model": str(final)})
    assert (spec.method, spec.num_speculative_tokens) == (
        "eagle3" if kind == "peagle" else kind, 3)
    assert spec.parallel_drafting == (kind == "peagle")
    assert greedy_lossless(train_target, {"model": str(final)}, [[5, 6, 7, 8]])


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A 1-layer LM with the target's tokenizer (the same BPE), to adapt into a PARD drafter."""
    from .conftest import save_train_target

    return save_train_target(tmp_path_factory.mktemp("draft"), layers=1, hidden=32, seed=1)


@pytest.mark.slow
def test_pard_recipe_end_to_end(tmp_path, train_target, chat_file, small_draft):
    cfg = make_cfg(tmp_path, train_target, chat_file, "recipe=tiny_pard",
                   f"drafter.model={small_draft}", "objective.pard_k=3")
    result = run(cfg)
    config = json.loads((result.final_dir / "config.json").read_text())
    assert isinstance(config["pard_token"], int)
    report = json.loads((tmp_path / "tiny_pard" / "eval" / "results.json").read_text())
    row = next(r for r in report["results"] if r["method"] == "tiny_pard")
    assert row["speculative_config"]["parallel_drafting"] is True and report["lossless"]
    assert greedy_lossless(train_target, {"method": "draft_model", "model": str(result.final_dir),
                                          "parallel_drafting": True,
                                          "num_speculative_tokens": 3}, [[5, 6, 7, 8]])


@pytest.mark.slow
def test_rerun_resumes_instead_of_retraining(tmp_path, train_target, chat_file):
    cfg = make_cfg(tmp_path, train_target, chat_file, "objective.ttt_steps=1",
                   "trainer.save_every=2", "eval.enabled=false")
    first = run(cfg)
    weights = (first.final_dir / "model.safetensors").read_bytes()
    ckpts = sorted(p.name for p in (tmp_path / "tiny_eagle3" / "checkpoints").iterdir())
    assert ckpts and ckpts[-1].endswith("4")
    again = run(cfg)  # resume=auto finds step 4 = max_steps: nothing left to train
    assert again.train.step == first.train.step == 4
    assert (again.final_dir / "model.safetensors").read_bytes() == weights


@pytest.mark.slow
def test_mlp_two_stage_recipe_end_to_end(tmp_path, train_target, chat_file, monkeypatch):
    """Stage 1 on the dataset, stage 2 on the target's own answers (regenerated), then eval; the
    frozen target's heads and model are loaded once for both stages."""
    import train.frozen_target as frozen

    loads = []
    for name in ("load_target_heads", "load_model"):
        real = getattr(frozen, name)
        monkeypatch.setattr(frozen, name, lambda *a, _n=name, _r=real, **k: (
            loads.append(_n), _r(*a, **k))[1])
    cfg = make_cfg(tmp_path, train_target, chat_file, "recipe=tiny_mlp", "drafter.inner_dim=32",
                   "objective.stage2_steps=2", "regenerate.num_examples=6",
                   "regenerate.max_tokens=8")
    result = run(cfg)
    run_dir = tmp_path / "tiny_mlp"
    assert sorted(loads) == ["load_model", "load_target_heads"]  # online, two stages
    assert result.train.step == 2  # the last stage's steps
    assert (run_dir / "checkpoints" / "stage2").is_dir()
    regenerated = list((run_dir / "stage2_data").glob("chunk_*.jsonl"))
    assert regenerated and sum(1 for _ in open(regenerated[0])) == 6
    config = json.loads((result.final_dir / "config.json").read_text())
    assert config["model_type"] == "mlp_speculator" and config["n_predict"] == 3
    assert greedy_lossless(train_target, {"method": "mlp_speculator",
                                          "model": str(result.final_dir)}, [[5, 6, 7, 8]])


@pytest.mark.slow
def test_regenerated_training_data(tmp_path, train_target, chat_file):
    cfg = make_cfg(tmp_path, train_target, chat_file, "regenerate.enabled=true",
                   "regenerate.num_examples=5", "regenerate.max_tokens=8", "eval.enabled=false",
                   "objective.ttt_steps=1")
    run(cfg)
    rows = [json.loads(line) for line in
            open(tmp_path / "tiny_eagle3" / "regenerated" / "chunk_00000.jsonl")]
    assert len(rows) == 5 and all(r["messages"][-1]["role"] == "assistant" for r in rows)


@pytest.mark.slow
def test_wandb_offline_run_has_training_and_acceptance(tmp_path, train_target, chat_file,
                                                       monkeypatch):
    """Without an API key the W&B run is offline; it holds the training curves and the
    end-of-training acceptance (the dashboard's two halves)."""
    from infer.foundation.tracking import read_wandb_file

    for key in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for key in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(key, str(tmp_path / "wandb-home" / key))
    cfg = make_cfg(tmp_path, train_target, chat_file, "logger.kind=wandb",
                   "objective.ttt_steps=2", "trainer.log_every=2")
    run(cfg)
    runs = list((tmp_path / "tiny_eagle3" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    data = read_wandb_file(runs[0])
    summary = data["summary"]
    assert "train/loss" in summary and "train/full_acc_1" in summary
    assert summary["eval/tiny_eagle3/k2/T0/b1/acceptance_length"] >= 1.0
    assert "eval/tiny_eagle3/k2/T0/b1/per_position/1" in summary


@pytest.mark.slow
def test_mtp_recipe_end_to_end(tmp_path, train_target, chat_file):
    """tiny_mtp through the whole pipeline on a Llama target: a stitched MiMo export that the
    schema serves as mtp (k from its num_nextn_predict_layers), losslessly."""
    cfg = make_cfg(tmp_path, train_target, chat_file, "recipe=tiny_mtp")
    final = run(cfg).final_dir
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["MiMoForCausalLM"]
    report = json.loads((tmp_path / "tiny_mtp" / "eval" / "results.json").read_text())
    assert "tiny_mtp" in {r["method"] for r in report["results"]} and report["lossless"] is True
    spec = SpeculativeConfig.parse({"method": "mtp", "model": str(final)})
    assert spec.num_speculative_tokens == 1
    assert greedy_lossless(train_target, {"method": "mtp", "model": str(final),
                                          "num_speculative_tokens": 3}, [[5, 6, 7, 8]])


def test_the_drafter_does_not_depend_on_what_data_preparation_drew(tmp_path, train_target,
                                                                    chat_file, monkeypatch):
    """A cold cache builds the embedded target or regenerates answers, drawing from the global
    RNG; a warm one does not. The trained drafter is the same either way (train.py seeds again
    before building it)."""
    import train.pipeline as pipeline

    def trained(out, draw):
        prepare = pipeline.prepare_data

        def drawing(*args, **kwargs):
            result = prepare(*args, **kwargs)
            torch.rand(draw)  # what a cold cache's work would have consumed
            return result

        monkeypatch.setattr(pipeline, "prepare_data", drawing)
        cfg = make_cfg(out, train_target, chat_file, "objective.ttt_steps=1",
                       "trainer.max_steps=2", "eval.enabled=false")
        final = run(cfg).final_dir
        monkeypatch.setattr(pipeline, "prepare_data", prepare)
        return (final / "model.safetensors").read_bytes()

    assert trained(tmp_path / "warm", 0) == trained(tmp_path / "cold", 1000)
