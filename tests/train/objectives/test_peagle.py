"""P-EAGLE objective: the depth layout by hand, COD chains, the training forward equals the
one-forward inference layout (the shift test), the loss falls, export -> load identical, the
export serves greedy-identically and refuses K above the depths trained."""

from __future__ import annotations

import json

import pytest
import torch

from infer.drafters.peagle import PEagleDrafter
from infer.engine import LLM
from infer.kv_cache import KVCache
from infer.sampling import SamplingParams
from train.objectives.pard import cod_selection
from train.objectives.peagle import PEagleObjective, peagle_rows
from .test_eagle3 import build, make_env, mean_eval_loss
from ..conftest import adam_steps

T_, F_ = True, False
M = 99


@pytest.fixture(scope="module")
def env(train_data):
    return make_env(train_data)


@pytest.fixture(scope="module")
def trained(env, train_data):
    obj = build("peagle", env, train_data, parallel_depths=3)
    before = mean_eval_loss(obj, env[2])
    adam_steps(obj, env[2])
    return obj, before, mean_eval_loss(obj, env[2])


def test_layout_by_hand():
    batch = {"input_ids": torch.tensor([[10, 11, 12, 13, 14]]),
             "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
             "doc_ids": torch.tensor([[0, 0, 0, 1, 1]]),
             "loss_mask": torch.tensor([[1, 1, 1, 1, 1]]).bool()}
    r = peagle_rows(batch, 3, M)  # depth 0: t 0..4, depth 1: 1..4, depth 2: 2..4
    assert r.depth.tolist() == [0] * 5 + [1] * 4 + [2] * 3
    assert r.input_ids[0].tolist() == [11, 12, 13, 14, 0] + [M] * 7  # depth 0: x_{t+1}
    # positions: anchor's position + depth (depth 1 at index 3 has anchor 2 of document 0)
    assert r.position_ids[0].tolist() == [0, 1, 2, 0, 1, 1, 2, 3, 1, 2, 3, 4]
    assert r.target_index.tolist() == [1, 2, 3, 4, 4, 2, 3, 4, 4, 3, 4, 4]
    # a row predicts x_{i+2}, a loss token of its anchor's document: only (depth 0, index 0)
    assert r.valid[0].tolist() == [T_] + [F_] * 11
    mask = r.attention_mask[0, 0]
    # depth 1 at index 2 (anchor 1): depth-0 rows 0, 1 and itself
    assert mask[6].nonzero().flatten().tolist() == [0, 1, 6]
    # depth 2 at index 4 crosses into document 1 (never valid): sees only document 1's keys
    assert mask[11].nonzero().flatten().tolist() == [7, 11]
    one_doc = {**batch, "doc_ids": torch.zeros(1, 5, dtype=torch.long),
               "position_ids": torch.arange(5)[None]}
    mask = peagle_rows(one_doc, 3, M).attention_mask[0, 0]
    # depth 2 at index 4 (anchor 2): depth-0 rows 0..2, depth 1 at index 3, itself
    assert mask[11].nonzero().flatten().tolist() == [0, 1, 2, 7, 11]
    # depth 0 causal (15), depth d rows see anchor + 1 real rows and d own rows (14, 12)
    assert not mask[0, 1:].any() and mask.sum() == 15 + 14 + 12


def test_cod_chains_are_contiguous_and_capped():
    gen = torch.Generator().manual_seed(0)
    t = 64
    eligible = torch.rand(t, generator=gen) < 0.8
    keep = cod_selection(t, 6, 0.7, 0.2, gen, eligible=eligible, max_keep=20)
    n = int(eligible.sum())
    assert torch.equal(keep[0], torch.arange(t))
    for d in range(1, 6):
        prev = set(keep[d - 1].tolist())
        assert all(i - 1 in prev and eligible[i] for i in keep[d].tolist())
        assert len(keep[d]) <= min(20, int((n - d) * max(0.7 ** d, 0.2)))
    assert len(keep[1]) == 20  # the cap binds at depth 1


@pytest.mark.parametrize("num_layers", [1, 2])
def test_training_forward_equals_inference_layout(env, train_data, num_layers):
    """Depth d of anchor a == the engine's one forward: the document's pairs up to a (cached),
    then K - 1 mask rows with prepare(mask_hidden), causal, logits at the last K rows; with the
    one EAGLE-3 layer and with a plain layer stacked on it (tiny_peagle's two)."""
    obj = build("peagle", env, train_data, seed=3, parallel_depths=4,
                num_layers=num_layers).eval()
    assert len(obj.drafter.layers) == num_layers
    batch = next(b for b in env[2] if int(b["doc_ids"][0].max()) >= 1)
    batch = {k: v[:1] for k, v in batch.items()}  # [1, T]
    docs, ids, aux = batch["doc_ids"][0], batch["input_ids"][0], batch["aux"]
    drafter, k = obj.drafter, obj.depths
    with torch.no_grad():
        r, logits = obj.rows(batch)  # all chains kept
        at = {(int(d), int(i)): n for n, (d, i) in enumerate(zip(r.depth, r.index))}
        start2 = int((docs == 1).nonzero()[0])
        for anchor in (3, start2 + 2, ids.shape[0] - 1 - k):
            first = int((docs == docs[anchor]).nonzero()[0])
            cache = KVCache.for_model(drafter.layer_config, 1, 256)
            g = drafter.prepare(aux[:, first:anchor + 1])  # [1, n, H]
            mask_g = drafter.mask_features().expand(1, k - 1, -1)
            toks = torch.cat([ids[first + 1:anchor + 2],
                              torch.full((k - 1,), drafter.config.mask_token_id)])[None]
            n = anchor - first + 1
            got, _ = drafter(toks, torch.cat([g, mask_g], 1), cache,
                             logits_at=torch.arange(n - 1, n + k - 1)[None])  # [1, K, Vd]
            for d in range(k):
                want = logits[0, at[(d, anchor + d)]]
                torch.testing.assert_close(got[0, d], want, atol=2e-5, rtol=1e-4)


def test_loss_falls_and_metrics(trained):
    obj, before, after = trained
    assert after < 0.85 * before, (before, after)


def test_metrics_names_and_cod_in_training(env, train_data):
    obj = build("peagle", env, train_data, parallel_depths=3, max_anchors=5).train()
    out = obj(env[2][0])
    for d in range(3):
        assert f"acc_{d}" in out.metrics and f"full_acc_{d}" in out.metrics
        assert f"loss/depth_{d}" in out.metrics
        assert out.metrics[f"full_acc_{d}"] <= out.metrics[f"acc_{d}"] + 1e-6
    assert "acceptance_length_est" in out.metrics
    keep = obj.selection(env[2][0])
    assert [len(x) for x in keep][1:] <= [5, 5] and len(keep[0]) == env[2][0]["input_ids"].shape[1]
    assert obj.drafter.embed_tokens is not None and obj.drafter.mask_hidden.requires_grad


def test_export_round_trip_and_serving(trained, env, train_data, tmp_path):
    obj = trained[0]
    path = obj.export(tmp_path / "head")
    raw = json.loads((path / "config.json").read_text())
    assert raw["speculators_model_type"] == "peagle" and raw["mask_token_id"] == \
        obj.drafter.config.mask_token_id
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert PEagleObjective.served_config(path) == {"method": "eagle3", "model": str(path),
                                                   "parallel_drafting": True}
    loaded = PEagleDrafter.from_pretrained(path)
    assert loaded.embed_tokens is not None  # the trained mask row ships
    batch = env[2][1]
    again = build("peagle", env, train_data, seed=5, parallel_depths=3).eval()
    again.drafter = loaded
    with torch.no_grad():
        # equal weights; the kernels may round differently (1e-6 on an AMD EPYC)
        torch.testing.assert_close(again.rows(batch)[1], obj.eval().rows(batch)[1],
                                   rtol=1e-5, atol=1e-5)
    # init_from a peagle export: same head, same mask state
    resumed = build("peagle", env, train_data, seed=9, parallel_depths=3,
                    init_from=str(path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(resumed(env[2][0]).loss, obj(env[2][0]).loss)
    prompts = ["def add(a, b):\n", "for i in range(10):\n    pri", "class Point:\n"]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    base = LLM(train_data.target_dir, max_num_seqs=2).generate(prompts, params)
    llm = LLM(train_data.target_dir, speculative_config=obj.speculative_config(path, 3),
              max_num_seqs=2)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [b.token_ids for b in base]
    metrics = llm.get_metrics()  # a trained head: drafts are accepted, so rollback is exercised
    assert metrics["num_drafts"] > 0 and metrics["num_accepted_tokens"] > 0, metrics
    with pytest.raises(ValueError, match="num_speculative_tokens.*at most 3"):
        LLM(train_data.target_dir, speculative_config=obj.speculative_config(path, 4))
