"""EAGLE-3 objective: TTT masks / shifts by hand, the unroll equals the inference chain, the loss
falls, step weights act, export round-trips to identical logits and serves greedy-identically."""

from __future__ import annotations

import dataclasses
import math
import json
from pathlib import Path

import pytest
import torch

from infer.drafters.common import StepKV, TTTKeys
from infer.drafters.eagle3 import Eagle3Drafter
from infer.engine import LLM
from infer.kv_cache import KVCache
from infer.models.loader import load_model
from infer.sampling import SamplingParams
from train.config import TrainConfig
from train.frozen_target import target_heads
from train.objectives.base import OBJECTIVES, FeatureSpec
from train.objectives.ttt import (StepStats, shift_left, step_valid, target_rows,
                                  ttt_attention_mask)
from ..conftest import adam_steps, feature_batches, method_cfg

T_, F_ = True, False


# ---- helpers shared with test_eagle.py / test_export.py ------------------------------------------

def make_cfg(method: str, **overrides) -> TrainConfig:
    """A TrainConfig with ``drafter.X`` / ``objective.X`` overrides given as ``X=value``."""
    settings = {"ttt_steps": 3} if method != "peagle" else {}
    return method_cfg(method, **{**settings, **overrides})


def make_env(train_data):
    """Native target, its heads and every packed row as a captured batch of 4 rows."""
    target = load_model(train_data.target_dir)
    spec = FeatureSpec(aux_layer_ids=(1, 2, 3), hidden=True, greedy=True)  # both EAGLE heads
    batches = feature_batches(train_data, target, spec, rows=len(train_data.dataset), size=4)
    return target, target_heads(target), batches


def build(method, env, train_data, seed=0, **overrides):
    torch.manual_seed(seed)
    return OBJECTIVES.get(method)(make_cfg(method, **overrides), env[1], train_data.vocab,
                                 train_data.target_dir)


def mean_eval_loss(obj, batches) -> float:
    obj.eval()
    with torch.no_grad():
        return sum(float(obj(b).loss) for b in batches) / len(batches)


def train_briefly(method, env, train_data):
    """``(objective, eval loss before, eval loss after)`` a few Adam steps on the env's batches."""
    obj = build(method, env, train_data)
    before = mean_eval_loss(obj, env[2])
    adam_steps(obj, env[2])
    return obj, before, mean_eval_loss(obj, env[2])


@pytest.fixture(scope="module")
def env(train_data):
    return make_env(train_data)


@pytest.fixture(scope="module")
def trained(env, train_data):
    return train_briefly("eagle3", env, train_data)


# ---- masks, shifts, metrics (by hand) -----------------------------------------------------------

def test_ttt_masks_two_documents_three_steps():
    docs = torch.tensor([[0, 0, 0, 1, 1]])
    causal = [[T_, F_, F_, F_, F_],
              [T_, T_, F_, F_, F_],
              [T_, T_, T_, F_, F_],
              [F_, F_, F_, T_, F_],
              [F_, F_, F_, T_, T_]]
    eye = [[T_, F_, F_, F_, F_],
           [F_, T_, F_, F_, F_],
           [F_, F_, T_, F_, F_],
           [F_, F_, F_, T_, F_],
           [F_, F_, F_, F_, T_]]
    for step in range(3):
        expected = torch.tensor([a + sum([e] * step, []) for a, e in zip(causal, eye)])
        mask = ttt_attention_mask(docs, step)
        assert mask.shape == (1, 5, 5 * (step + 1))
        assert torch.equal(mask[0], expected)
    # step 2, query 4 (second document): step-0 keys 3, 4; then its own keys of steps 1 and 2
    assert ttt_attention_mask(docs, 2)[0, 4].nonzero().flatten().tolist() == [3, 4, 9, 14]


def test_step_validity_and_shift_by_hand():
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    loss = torch.tensor([[0, 1, 1, 1, 0, 1, 1]]).bool()
    # step s trains anchor t on token t + 2 + s: a loss token of the same document
    assert step_valid(loss, docs, 0)[0].tolist() == [T_, T_, F_, F_, T_, F_, F_]
    assert step_valid(loss, docs, 1)[0].tolist() == [T_, F_, F_, F_, F_, F_, F_]
    assert step_valid(loss, docs, 2)[0].tolist() == [F_] * 7
    assert step_valid(loss, docs, 5)[0].tolist() == [F_] * 7  # past the row: nothing
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    assert shift_left(ids, 2).tolist() == [[12, 13, 14, 0, 0]]
    assert shift_left(ids, 7).tolist() == [[0] * 5]


def test_step_stats_by_hand():
    stats = StepStats()
    loss = torch.tensor(1.0)
    stats.add(0, loss, torch.tensor([[T_, T_, F_, T_]]), torch.tensor([[T_, T_, T_, T_]]), {})
    stats.add(1, loss, torch.tensor([[T_, F_, T_, T_]]), torch.tensor([[T_, T_, T_, F_]]), {})
    m = {k: float(v) for k, v in stats.metrics.items()}
    assert m["acc_0"] == m["full_acc_0"] == m["cond_acc_0"] == pytest.approx(3 / 4)
    assert m["acc_1"] == pytest.approx(2 / 3)  # valid 0, 1, 2: right at 0 and 2
    assert m["full_acc_1"] == pytest.approx(1 / 3)  # only anchor 0 right at both steps
    assert m["cond_acc_1"] == pytest.approx(1 / 2)  # of valid anchors right at 0 (0, 1): anchor 0
    assert m["acceptance_length_est"] == pytest.approx(1 + 3 / 4 + 1 / 3)


# ---- the unroll is the inference chain ----------------------------------------------------------

@pytest.mark.parametrize("num_layers", [1, 2])
def test_unroll_equals_cached_inference_chain(env, train_data, num_layers):
    """Step s at anchor t == the engine's chain: catch up on the document's pairs up to t, then
    feed the head's own state with the true next tokens, one cached forward per draft (one
    decoder layer, and two: the TTT keys of every layer)."""
    obj = build("eagle3", env, train_data, seed=3, num_layers=num_layers).eval()
    assert len(obj.drafter.layers) == num_layers
    batch = next(b for b in env[2] if int(b["doc_ids"][0].max()) >= 1)
    batch = {k: v[:1] for k, v in batch.items()}  # [1, T]
    docs, ids, aux = batch["doc_ids"][0], batch["input_ids"][0], batch["aux"]
    drafter, steps, t_len = obj.drafter, obj.ttt_steps, ids.shape[0]
    with torch.no_grad():
        chain = [logits[0] for logits, _ in obj.unroll(batch)]  # steps x [T, Vd]
        start2 = int((docs == 1).nonzero()[0])
        for anchor in (3, start2 + 2, t_len - 1 - steps):
            first = int((docs == docs[anchor]).nonzero()[0])  # the anchor's document start
            cache = KVCache.for_model(drafter.layer_config, 1, 256)
            g = drafter.prepare(aux[:, first:anchor + 1])  # [1, n, H]
            toks = ids[first + 1:anchor + 2][None]  # [1, n]
            logits, h = drafter(toks, g, cache, logits_at=torch.tensor([[anchor - first]]))
            for s in range(steps):
                if s:
                    logits, h = drafter(ids[anchor + 1 + s].view(1, 1), h, cache)
                torch.testing.assert_close(logits[0, 0], chain[s][anchor], atol=2e-5, rtol=1e-4)


# ---- training -----------------------------------------------------------------------------------

def test_loss_falls_and_metrics(trained):
    obj, before, after = trained
    assert after < 0.85 * before, (before, after)
    spec = obj.feature_spec()
    assert spec.aux_layer_ids == (1, 2, 3) and spec.hidden


def test_step_weights_matter(env, train_data):
    batch = env[2][0]
    half = build("eagle3", env, train_data, step_weight=0.5).eval()
    out = half(batch)
    steps = [out.metrics[f"loss/step_{s}"] for s in range(3)]
    assert torch.allclose(out.loss, steps[0] + 0.5 * steps[1] + 0.25 * steps[2])
    assert int(out.num_tokens) == int(step_valid(batch["loss_mask"], batch["doc_ids"], 0).sum())

    def grads(obj):
        obj.zero_grad()
        obj(batch).loss.backward()
        return torch.cat([p.grad.flatten() for p in obj.drafter.parameters() if p.grad is not None])

    zero = build("eagle3", env, train_data, step_weight=0.0).eval()
    one_step = build("eagle3", env, train_data, ttt_steps=1).eval()
    full = build("eagle3", env, train_data, step_weight=1.0).eval()
    for o in (zero, one_step, full):
        o.drafter.load_state_dict(half.drafter.state_dict())
    g0 = grads(zero)
    torch.testing.assert_close(g0, grads(one_step))  # weight 0 ** s: only step 0 trains
    assert not torch.allclose(g0, grads(full), atol=1e-6)  # later steps pull the head too


def test_feature_noise_only_while_training(env, train_data):
    obj = build("eagle3", env, train_data, feature_noise=0.5)
    batch = env[2][0]
    obj.eval()
    assert torch.equal(obj(batch).loss, obj(batch).loss)
    obj.train()
    torch.manual_seed(1)
    assert not torch.equal(obj(batch).loss, obj.eval()(batch).loss)


# ---- config errors ------------------------------------------------------------------------------

def test_negative_aux_ids_count_from_the_end(env, train_data):
    """-1 = the last layer's output (4 on this 4-layer target): a recipe names it whatever the
    depth, and the checkpoint holds the resolved ids vLLM reads."""
    obj = build("eagle3", env, train_data, aux_layer_ids=[2, -5, -1])
    assert obj.feature_spec().aux_layer_ids == (0, 2, 4)
    assert obj.drafter.config.eagle_aux_hidden_state_layer_ids == [0, 2, 4]


@pytest.mark.parametrize("ids", [[1, 1, 2], [0, 5], [], [1, 2, "3"], [-6], [1, -4]])
def test_bad_aux_ids_name_the_key(env, train_data, ids):
    with pytest.raises(ValueError, match=r"drafter\.aux_layer_ids.*expected.*\[0, 4\]"):
        build("eagle3", env, train_data, aux_layer_ids=ids)


def test_small_target_needs_explicit_aux_ids(env, train_data):
    heads = dataclasses.replace(env[1], config=dataclasses.replace(env[1].config, num_layers=3))
    cfg = make_cfg("eagle3")
    with pytest.raises(ValueError, match=r"drafter\.aux_layer_ids.*3-layer target"):
        OBJECTIVES.get("eagle3")(cfg, heads, train_data.vocab, train_data.target_dir)
    cfg.drafter.aux_layer_ids = [0, 3]  # the embeddings and the last layer are allowed here
    obj = OBJECTIVES.get("eagle3")(cfg, heads, train_data.vocab, train_data.target_dir)
    assert obj.feature_spec().aux_layer_ids == (0, 3)


def test_bad_objective_settings_name_the_key(env, train_data):
    with pytest.raises(ValueError, match=r"objective\.ttt_steps.*0"):
        build("eagle3", env, train_data, ttt_steps=0)
    with pytest.raises(ValueError, match=r"objective\.step_weight"):
        build("eagle3", env, train_data, step_weight=-1.0)


# ---- export -------------------------------------------------------------------------------------

def _assert_same_logits(obj, loaded, batch):
    with torch.no_grad():
        mine = obj.drafter.forward_train(batch["input_ids"], obj.drafter.prepare(batch["aux"]),
                                         batch["position_ids"], ttt_attention_mask(
                                             batch["doc_ids"], 0))
        theirs = loaded.forward_train(batch["input_ids"], loaded.prepare(batch["aux"]),
                                      batch["position_ids"], ttt_attention_mask(
                                          batch["doc_ids"], 0))
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])


def test_token_map_export_is_the_most_frequent_draft_tokens_and_is_served(env, train_data,
                                                                           tmp_path):
    """``drafter.token_map_size``: export writes the most frequent training targets of the draft
    vocabulary beside the weights, the served config names it, and the engine's reader takes it;
    without the key there is no file and no entry."""
    from infer.drafters.common import read_token_map

    vocab = train_data.vocab
    obj = build("eagle3", env, train_data, token_map_size=10)
    path = obj.export(tmp_path / "head")
    ids = vocab.target_ids()
    counts = vocab.counts[ids]
    got = read_token_map(path / "speculative_token_map.json", vocab.target_vocab_size)
    assert got.numel() == 10 and bool(vocab.t2d[got].all())
    assert counts[torch.isin(ids, got)].min() >= counts[~torch.isin(ids, got)].max()
    assert obj.served_config(path)["speculative_token_map"] == str(
        path / "speculative_token_map.json")
    plain = build("eagle3", env, train_data).export(tmp_path / "plain")
    assert not (plain / "speculative_token_map.json").exists()
    assert "speculative_token_map" not in obj.served_config(plain)


def test_export_round_trip_identical_logits(trained, env, train_data, tmp_path):
    obj = trained[0]
    path = obj.export(tmp_path / "head")
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["Eagle3DraftModel"] and raw["draft_vocab_size"] == 128
    assert raw["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert raw["speculators_config"]["verifier"]["name_or_path"] == train_data.target_dir
    loaded = Eagle3Drafter.from_pretrained(path)
    assert loaded.embed_tokens is None  # the target's embedding is shared, not shipped
    assert torch.equal(loaded.to_target_ids(torch.arange(128)), train_data.vocab.target_ids())
    loaded.share_embedding(env[1].embed_tokens)
    _assert_same_logits(obj, loaded, env[2][1])
    # a trainer-gathered state dict (drafter.* keys) exports the same weights
    again = obj.export(tmp_path / "again", {k: v.clone() for k, v in obj.state_dict().items()})
    assert (again / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    # init_from: a new objective starts from the exported weights
    resumed = build("eagle3", env, train_data, seed=9, init_from=str(path)).eval()
    with torch.no_grad():
        assert torch.allclose(resumed(env[2][0]).loss, obj(env[2][0]).loss)


def test_own_embedding_is_trained_and_shipped(env, train_data, tmp_path):
    obj = build("eagle3", env, train_data, embed_requires_grad=True)
    emb = obj.drafter.embed_tokens.weight
    assert emb.requires_grad and torch.equal(emb, env[1].embed_tokens.weight)
    adam_steps(obj, env[2], steps=2)
    assert not torch.equal(obj.drafter.embed_tokens.weight, env[1].embed_tokens.weight)
    loaded = Eagle3Drafter.from_pretrained(obj.export(tmp_path / "own"))
    assert loaded.embed_tokens is not None  # no share_embedding needed
    _assert_same_logits(obj, loaded, env[2][0])


def test_init_from_other_vocab_maps_head_rows(trained, env, train_data, tmp_path):
    obj = trained[0]
    path = obj.export(tmp_path / "head")
    ids = train_data.vocab.target_ids()  # [128] ascending
    unseen = next(i for i in range(400) if i not in set(ids.tolist()))
    new_ids = torch.cat([ids[1:], torch.tensor([unseen])]).sort().values  # drop one, add one
    vocab = dataclasses.replace(train_data.vocab, d2t=new_ids - torch.arange(128),
                                t2d=torch.zeros_like(train_data.vocab.t2d))
    vocab.t2d[new_ids] = True
    vocab.check()
    cfg = make_cfg("eagle3", init_from=str(path))
    moved = OBJECTIVES.get("eagle3")(cfg, env[1], vocab, train_data.target_dir)
    old_row = {int(t): i for i, t in enumerate(ids)}
    for i, tok in enumerate(new_ids.tolist()):  # every kept token keeps its trained row
        if tok in old_row:
            assert torch.equal(moved.drafter.lm_head.weight[i],
                               obj.drafter.lm_head.weight[old_row[tok]])
        else:
            assert not torch.equal(moved.drafter.lm_head.weight[i],
                                   obj.drafter.lm_head.weight[0])
    with pytest.raises(ValueError, match=r"drafter\.aux_layer_ids.*init_from"):
        build("eagle3", env, train_data, init_from=str(path), aux_layer_ids=[0, 2, 4])
    with pytest.raises(ValueError, match=r"drafter\.norm_before_residual"):
        build("eagle3", env, train_data, init_from=str(path), norm_before_residual=False)


def test_served_greedy_output_identical(trained, train_data, tmp_path):
    path = trained[0].export(tmp_path / "served")
    prompts = ["def add(a, b):\n", "for i in range(10):\n    pri", "class Point:\n"]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    base = LLM(train_data.target_dir, max_num_seqs=2).generate(prompts, params)
    spec = {"method": "eagle3", "model": str(path), "num_speculative_tokens": 3}
    llm = LLM(train_data.target_dir, speculative_config=spec, max_num_seqs=2)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert llm.get_metrics()["num_drafts"] > 0


# ---- trainer quality: full-vocab accuracy, LM head init, keys -----------------------------------

def test_loss_at_trained_positions_equals_the_loss_over_whole_rows(env, train_data):
    """The LM head, the targets and the KL are computed only where a step trains
    (``forward_train(select=)``, ``target_rows``); loss, accuracy and gradients equal those of
    the same computation over every position of every row, masked afterwards."""
    obj = build("eagle3", env, train_data, seed=3, step_weight=0.8).eval()
    batch = env[2][1]
    mask, docs = batch["loss_mask"].bool(), batch["doc_ids"]  # [B, T]
    t = mask.shape[1]
    ids = train_data.vocab.target_ids()
    params = [p for p in obj.drafter.parameters() if p.requires_grad]
    out = obj(batch)
    got = torch.autograd.grad(out.loss, params)
    logp = torch.log_softmax(batch["hidden"] @ env[1].lm_head.weight[ids].T, -1)  # [B, T, Vd]
    greedy = env[1].lm_head(batch["hidden"]).argmax(-1)  # [B, T]
    want = 0.0
    for s, (logits, _) in enumerate(obj.unroll(batch)):  # logits [B, T, Vd] everywhere
        valid = step_valid(mask, docs, s)[:, : t - 1 - s]  # [B, n]
        target = logp[:, 1 + s:]  # [B, n, Vd]
        kl = (target.exp() * (target - torch.log_softmax(logits[:, : t - 1 - s], -1))).sum(-1)
        want = want + 0.8 ** s * kl[valid].mean()
        right = ids[logits[:, : t - 1 - s].argmax(-1)] == greedy[:, 1 + s:]  # [B, n]
        assert torch.allclose(out.metrics[f"acc_{s}"], right[valid].float().mean())
    assert torch.allclose(out.loss, want, rtol=1e-5)
    for g, w in zip(got, torch.autograd.grad(want, params)):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-7)


def test_unroll_attends_as_the_dense_ttt_mask(env, train_data, monkeypatch):
    """The unroll's chunked TTT attention (``TTTKeys``, 7 query chunks over rows that pack
    several documents) gives the logits and the loss gradients of the same unroll over
    concatenated keys with the dense ``ttt_attention_mask``."""
    monkeypatch.setattr(TTTKeys, "chunks", 7)
    obj = build("eagle3", env, train_data, seed=3).eval()
    batch = env[2][1]
    ids, pos, docs = batch["input_ids"], batch["position_ids"], batch["doc_ids"]  # [B, T]
    assert ids.shape[1] % 7 and docs.max() > 0
    params = [p for p in obj.drafter.parameters() if p.requires_grad]
    got, want = 0.0, 0.0
    hidden, kv = obj.features(batch), StepKV()  # [B, T, H]
    for s, (logits, _) in enumerate(obj.unroll(batch)):  # [B, T, Vd] each
        ref, hidden = obj.drafter.forward_train(shift_left(ids, 1 + s), hidden, pos + s,
                                                ttt_attention_mask(docs, s), kv)
        assert torch.allclose(logits, ref, atol=1e-5, rtol=1e-5)
        got, want = got + logits.logsumexp(-1).mean(), want + ref.logsumexp(-1).mean()
    for g, w in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-6)


def test_accuracy_is_against_the_full_vocabulary_argmax(env, train_data):
    """A head proposing the target's best draft-vocabulary token is still wrong wherever the
    target's greedy token lies outside the draft vocabulary; that rate is logged."""
    obj = build("eagle3", env, train_data)
    batch = env[2][0]
    rows = target_rows(batch["loss_mask"])  # [B, T]
    with torch.no_grad():
        targets = obj.targets(batch, rows)  # [M, ...]
    greedy = env[1].lm_head(batch["hidden"]).argmax(-1)  # [B, T] over the full vocabulary
    assert torch.equal(targets["argmax"], greedy[rows])
    oov = ~train_data.vocab.t2d[greedy]  # [B, T]
    assert 0 < oov.float().mean() < 1
    best_in_vocab = targets["logp"]  # [M, Vd]: a perfect draft-vocab proposal
    _, correct, extras = obj.step_loss(0, best_in_vocab, None, targets)
    assert torch.equal(correct, ~oov[rows])
    assert torch.equal(extras["oov_rate"], oov[rows].float())
    metrics = obj(batch).metrics
    valid = step_valid(batch["loss_mask"], batch["doc_ids"], 0)
    want = oov[:, 1:][valid[:, :-1]].float().mean()
    assert torch.allclose(metrics["oov_rate/step_0"], want)


def test_argmax_weight_adds_the_cross_entropy_of_the_target_greedy_token(env, train_data):
    """``objective.argmax_weight: w``: KL + w * CE(the target's greedy token) per position, by
    hand; where that token lies outside the draft vocabulary the KL alone (nothing to match)."""
    plain = build("eagle3", env, train_data).eval()
    weighted = build("eagle3", env, train_data, argmax_weight=0.5).eval()
    batch = env[2][0]
    rows = target_rows(batch["loss_mask"])  # [B, T]
    with torch.no_grad():
        targets = weighted.targets(batch, rows)  # [M, ...]
    torch.manual_seed(3)
    logits = torch.randn(targets["logp"].shape)  # [M, Vd] any proposal
    kl, _, _ = plain.step_loss(0, logits, None, targets)
    loss, _, _ = weighted.step_loss(0, logits, None, targets)
    draft_of = {int(t): d for d, t in enumerate(train_data.vocab.target_ids())}
    oov = targets["oov"]
    assert 0 < oov.float().mean() < 1
    for m in range(logits.shape[0]):
        want = kl[m]
        if not oov[m]:
            best = draft_of[int(targets["argmax"][m])]
            want = want + 0.5 * -torch.log_softmax(logits[m], -1)[best]
        torch.testing.assert_close(loss[m], want)


def test_lm_head_starts_from_the_target_rows(env, train_data):
    rows = env[1].lm_head.weight[train_data.vocab.target_ids()]  # [Vd, H]
    assert torch.equal(build("eagle3", env, train_data).drafter.lm_head.weight, rows)
    random = build("eagle3", env, train_data, lm_head_init="random").drafter.lm_head.weight
    assert not torch.allclose(random, rows)


def test_norm_before_fc_is_a_drafter_key(env, train_data):
    obj = build("eagle3", env, train_data, norm_before_fc=True)
    assert obj.drafter.config.norm_before_fc and obj.drafter.input_norm is not None
    assert build("eagle3", env, train_data).drafter.input_norm is None


def test_layer_from_target_starts_from_the_targets_last_layer(env, train_data):
    from safetensors.torch import load_file

    from infer.models.loader import weight_files

    obj = build("eagle3", env, train_data, layer_from_target=True)
    state = {}
    for file in weight_files(Path(train_data.target_dir)):
        state.update(load_file(file))
    last = f"model.layers.{env[1].config.num_layers - 1}."
    layer, h = obj.drafter.layers[0], obj.drafter.config.layer.hidden_size
    for proj in ("q_proj", "k_proj", "v_proj"):  # both halves of the 2H input
        w = getattr(layer.self_attn, proj).weight
        assert torch.equal(w[:, :h], state[last + f"self_attn.{proj}.weight"])
        assert torch.equal(w[:, h:], state[last + f"self_attn.{proj}.weight"])
    assert torch.equal(layer.mlp.down_proj.weight, state[last + "mlp.down_proj.weight"])
    assert torch.equal(layer.hidden_norm.weight, state[last + "input_layernorm.weight"])
    assert torch.equal(obj.drafter.norm.weight, state["model.norm.weight"])
    fc = obj.drafter.fc.weight  # identity on the last aux stream, nothing from the others
    assert torch.equal(fc[:, -h:], torch.eye(h)) and not fc[:, :-h].any()
    fresh = build("eagle3", env, train_data).drafter.layers[0].mlp.down_proj.weight
    assert not torch.equal(fresh, layer.mlp.down_proj.weight)


def test_layer_from_target_refuses_a_head_of_another_width(env, train_data):
    width = env[1].config.intermediate_size + 8
    with pytest.raises(ValueError, match=rf"drafter\.intermediate_size.*{width}.*MLP width"):
        build("eagle3", env, train_data, layer_from_target=True, intermediate_size=width)


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_objective_loss_reaches_the_step_loss_and_eal_is_logged(env, train_data, method):
    """objective.loss=tv trains 1 - acceptance instead of KL: a loss in [0, 1] per position,
    different from KL's on the same batch; eal = sum_k prod_{i<=k} acc_i beside the accuracies."""
    batch = env[2][0]
    with torch.no_grad():
        kl = build(method, env, train_data)(batch)
        tv = build(method, env, train_data, loss="tv")(batch)
    assert not torch.isclose(kl.loss, tv.loss)
    want = sum(math.prod(float(tv.metrics[f"acc_{i}"]) for i in range(s + 1)) for s in range(3))
    assert float(tv.metrics["eal"]) == pytest.approx(want, rel=1e-5)


def test_dpace_position_weights_replace_the_geometric_total(env, train_data):
    batch = env[2][0]
    geometric = build("eagle3", env, train_data)(batch)
    dpace = build("eagle3", env, train_data, position_weights="dpace")(batch)
    assert not torch.isclose(geometric.loss, dpace.loss) and dpace.loss.requires_grad
    dpace.loss.backward()  # trains: gradients reach the head
