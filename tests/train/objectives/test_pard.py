"""PARD objective: the k-copy attention mask and position ids (hand-checked), no masked copy sees
what it must predict, COD nesting and fractions, training matches the serving input, export ->
transformers / draftsmith load with identical logits, training lowers the loss, and the engine
serves the export losslessly (draft_model + parallel_drafting)."""

import json
import random

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from infer import LLM
from infer.models.loader import load_config, load_model
from train.frozen_target import target_heads
from train.objectives.base import OBJECTIVES, FeatureSpec
from train.objectives.pard import (PardObjective, chain_accuracy, choose_mask_token, cod_selection,
                                   pard_batch)
from train.vocab import DraftVocab
from ..conftest import adam_steps, feature_batches, own_continuations, method_cfg

M = 99  # mask id in the layout tests


def save_draft(path, vocab_size, tokenizer_from, *, seed=0, **config):
    """A 2-layer random Llama draft sharing the target's tokenizer (saved beside it)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None,
                      **config)
    LlamaForCausalLM(cfg).save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def target(train_target):
    return load_model(train_target, dtype=torch.float32)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, train_target):
    tok = AutoTokenizer.from_pretrained(train_target)
    return save_draft(tmp_path_factory.mktemp("draft"), load_config(train_target).vocab_size,
                      train_target, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


@pytest.fixture(scope="module")
def batches(train_data, target):
    return feature_batches(train_data, target, FeatureSpec(hidden=True), rows=12, size=3)


def make(train_target, target, vocab, model, k=3, **settings):
    cfg = method_cfg("pard", model=model, pard_k=k, **settings)
    return OBJECTIVES.get("pard")(cfg, target_heads(target), vocab, train_target)


def hand_batch():
    """T = 4: document 0 = tokens 11 12 13, document 1 = token 14 (document starts: mask 0)."""
    return {"input_ids": torch.tensor([[11, 12, 13, 14]]),
            "position_ids": torch.tensor([[0, 1, 2, 0]]),
            "doc_ids": torch.tensor([[0, 0, 0, 1]]),
            "loss_mask": torch.tensor([[0, 1, 1, 0]]).bool()}


def test_hand_written_mask_and_positions():
    pb = pard_batch(hand_batch(), k=3, mask_id=M)
    # rows/cols: copy 0 (t=0..3) | copy 1 (t=0..3) | copy 2 (t=0..3)
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # (0,0) causal
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # (0,1)
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # (0,2)
        [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0],  # (0,3) new document
        [0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0],  # (1,0) no real context: only itself
        [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0],  # (1,1) real <= 0, itself
        [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0],  # (1,2) real <= 1, itself
        [0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0],  # (1,3) real <= 2 are in document 0
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],  # (2,0) itself
        [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0],  # (2,1) mask (1,0) on its diagonal, itself
        [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],  # (2,2) real 0, mask (1,1), itself
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],  # (2,3) (1,2) and real <= 1: document 0
    ], dtype=torch.bool)
    assert torch.equal(pb.attention_mask[0, 0], expected)
    assert pb.input_ids[0].tolist() == [11, 12, 13, 14] + [M] * 8
    assert pb.position_ids[0].tolist() == [0, 1, 2, 0] * 3
    # trained: (0,0) -> 12, (0,1) -> 13, (1,1) -> 13 (draft 2 after token 11); (2,2) would
    # predict token 3, which starts document 1
    valid = [1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0]
    assert pb.valid[0].int().tolist() == valid
    assert pb.targets[0][pb.valid[0]].tolist() == [12, 13, 13]


def test_per_copy_and_chained_accuracy_by_hand():
    """full_acc_j: drafts 1..j+1 from the same context all right (copy j' at t - j + j')."""
    batch = {"input_ids": torch.tensor([[11, 12, 13, 14]]), "doc_ids": torch.zeros(1, 4).long(),
             "position_ids": torch.arange(4)[None],
             "loss_mask": torch.tensor([[0, 1, 1, 1]]).bool()}
    pb = pard_batch(batch, 3, M)
    assert pb.valid[0].int().tolist() == [1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 0]
    right = torch.tensor([[1, 0, 1, 0, 0, 1, 1, 0, 0, 0, 1, 0]]).bool()
    ce = torch.arange(12.0)[None]
    m = chain_accuracy(pb.copy, pb.index, pb.valid, right, ce, 3, 4)
    assert [m[f"acc_{j}"].item() for j in range(3)] == pytest.approx([2 / 3, 1, 1])
    # copy 1: t=1 right after (0,0) right; t=2 right but (0,1) wrong. copy 2: (0,0),(1,1),(2,2)
    assert [m[f"full_acc_{j}"].item() for j in range(3)] == pytest.approx([2 / 3, 1 / 2, 1])
    assert [m[f"loss/copy_{j}"].item() for j in range(3)] == pytest.approx([1, 5.5, 10])
    assert m["acceptance_length_est"].item() == pytest.approx(1 + 2 / 3 + 1 / 2 + 1)


def test_dropped_positions_are_cut_out():
    """COD: the kept layout is the full one restricted to the kept positions."""
    batch = hand_batch()
    full = pard_batch(batch, 3, M)
    keep = [torch.arange(4), torch.tensor([1, 3]), torch.tensor([2])]
    pb = pard_batch(batch, 3, M, keep)
    flat = torch.tensor([0, 1, 2, 3, 5, 7, 10])  # copy * T + index
    assert torch.equal(pb.attention_mask[0, 0], full.attention_mask[0, 0][flat][:, flat])
    for name in ("input_ids", "position_ids", "valid", "targets"):
        assert torch.equal(getattr(pb, name), getattr(full, name)[:, flat]), name


def test_masked_copy_never_sees_what_it_predicts():
    """Random rows, documents and COD selections: query (j, t) sees real tokens only up to
    t - j, masks elsewhere, the same keys as without dropping, and at least itself."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        t, k = rng.randint(3, 24), rng.randint(1, 6)
        cuts = sorted(rng.sample(range(1, t), rng.randint(0, min(3, t - 1))))
        doc = torch.tensor([sum(c <= i for c in cuts) for i in range(t)])[None]
        ids = torch.randint(0, 50, (1, t))
        batch = {"input_ids": ids, "doc_ids": doc, "position_ids": torch.arange(t)[None],
                 "loss_mask": torch.ones(1, t, dtype=torch.bool)}
        keep = cod_selection(t, k, rng.uniform(0.3, 1.0), rng.uniform(0.1, 0.5), gen)
        pb, full = pard_batch(batch, k, M, keep), pard_batch(batch, k, M)
        mask = pb.attention_mask[0, 0]
        assert mask.diagonal().all()
        for q in range(len(pb.copy)):
            j, i = pb.copy[q].item(), pb.index[q].item()
            for key in mask[q].nonzero().flatten().tolist():
                kc, ki = pb.copy[key].item(), pb.index[key].item()
                assert doc[0, ki] == doc[0, i]
                if kc == 0:
                    assert ki <= i - j  # never the token it predicts (i + 1) or the ones before
                else:
                    assert pb.input_ids[0, key] == M and ki - kc == i - j  # its diagonal
            # every key the full layout shows this query was kept
            fq = j * t + i
            assert mask[q].sum() == full.attention_mask[0, 0, fq].sum()
            if pb.valid[0, q]:
                assert pb.targets[0, q] == ids[0, i + 1] and i - j >= 0


def test_cod_nesting_and_fractions():
    t, k, ratio, minimum = 100, 7, 0.7, 0.2
    gen = torch.Generator().manual_seed(1)
    hits = torch.zeros(t)
    draws = 400
    for _ in range(draws):
        keep = cod_selection(t, k, ratio, minimum, gen)
        assert torch.equal(keep[0], torch.arange(t))
        for i in range(1, k):
            assert set((keep[i] - 1).tolist()) <= set(keep[i - 1].tolist())  # nested
            successors = int((keep[i - 1] < t - 1).sum())  # index t - 1 has no successor
            assert len(keep[i]) == min(int(t * max(ratio ** i, minimum)), successors)
            assert len(set(keep[i].tolist())) == len(keep[i])
        hits[keep[1]] += 1
    # copy 1 keeps 70 of the 99 successors uniformly: each t >= 1 with probability 70/99
    assert hits[0] == 0
    freq = hits[1:] / draws
    assert (freq - 70 / 99).abs().max() < 0.1
    assert freq.mean().item() == pytest.approx(70 / 99, abs=1e-6)
    # about 3x cheaper than keeping all k copies
    total = sum(len(x) for x in cod_selection(t, 8, ratio, minimum, gen))
    assert 2.2 < 8 * t / total < 2.6  # 8 copies -> ~3.4 copies' worth of positions


def test_training_layout_matches_serving_input(train_target, target, train_data, draft_dir,
                                               batches):
    """Copy j at t gives the logits the engine computes for [doc start .. t - j, MASK x j]."""
    obj = make(train_target, target, train_data.vocab, draft_dir, k=4).eval()
    batch = {k: v[:1] for k, v in batches[0].items()}
    with torch.no_grad():
        pb, logits = obj.draft_logits(batch)
        ids, doc = batch["input_ids"][0], batch["doc_ids"][0]
        starts = [int((doc == doc[i]).nonzero()[0]) for i in range(len(doc))]
        checked = 0
        for q in pb.valid[0].nonzero().flatten().tolist()[::7]:
            j, i = pb.copy[q].item(), pb.index[q].item()
            ctx = ids[starts[i]: i - j + 1].tolist() + [obj.mask_token_id] * j
            out = obj.drafter.forward_train(torch.tensor([ctx])).logits[0, -1]
            torch.testing.assert_close(logits[0, q], out, rtol=1e-4, atol=1e-4)
            checked += j > 0
        assert checked >= 3


def test_mask_token_choice(train_target, target, train_data):
    cfg, vocab = target.config, train_data.vocab
    assert choose_mask_token(7, {}, vocab, cfg) == 7
    assert choose_mask_token(None, {"pard_token": 5}, vocab, cfg) == 5
    assert choose_mask_token(None, {"ptd_token_id": 6}, vocab, cfg) == 6
    counts = torch.ones(cfg.vocab_size, dtype=torch.long)
    counts[[3, 40, cfg.vocab_size - 1]] = 0  # the top one is EOS here: special, skipped
    fake = DraftVocab(vocab.d2t, vocab.t2d, counts)
    assert choose_mask_token(None, {"eos_token_id": cfg.vocab_size - 1}, fake, cfg) == 40
    special = set(cfg.eos_token_ids) | {cfg.pad_token_id}
    unseen = [i for i in (vocab.counts == 0).nonzero().flatten().tolist() if i not in special]
    assert choose_mask_token(None, {}, vocab, cfg) == max(unseen)  # highest never-trained id
    with pytest.raises(ValueError, match=r"'drafter.mask_token_id': 352; expected a token id "
                                         r"in \[0, 352\)"):
        choose_mask_token(cfg.vocab_size, {}, vocab, cfg)
    with pytest.raises(ValueError, match="set drafter.mask_token_id"):
        choose_mask_token(None, {}, DraftVocab(vocab.d2t, vocab.t2d, torch.ones_like(counts)),
                          cfg)


def test_vocab_mismatch_is_an_error(tmp_path, train_target, target, train_data):
    bad = save_draft(tmp_path / "bad", 300, train_target)
    with pytest.raises(ValueError, match=r"'drafter.model'.*vocab_size \(352.*300"):
        make(train_target, target, train_data.vocab, bad)


def test_export_loads_in_transformers_and_draftsmith(tmp_path, train_target, target, train_data,
                                                     draft_dir, batches):
    obj = make(train_target, target, train_data.vocab, draft_dir, mask_token_id=350)
    with torch.no_grad():
        for p in obj.drafter.parameters():  # not the saved draft any more
            p.add_(0.01 * torch.randn_like(p))
    ids = batches[0]["input_ids"][:2, :40]
    want = obj.drafter.forward_train(ids).logits.detach()
    path = obj.export(tmp_path / "pard", {f"drafter.{k}": v for k, v in
                                          obj.drafter.state_dict().items()})
    config = json.loads((path / "config.json").read_text())
    assert config["pard_token"] == 350 and config["vocab_size"] == 352
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "model.layers.0.self_attn.q_proj.weight" in f.keys() and "lm_head.weight" in f.keys()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.testing.assert_close(hf(ids).logits, want, rtol=1e-4, atol=1e-4)
    native = load_model(path, dtype=torch.float32)
    torch.testing.assert_close(native.forward_train(ids).logits, want, rtol=0, atol=1e-5)
    assert AutoTokenizer.from_pretrained(path).get_vocab() == train_data.tokenizer.get_vocab()
    # init_from continues from the export, mask token included
    again = make(train_target, target, train_data.vocab, None, init_from=str(path))
    assert again.mask_token_id == 350
    torch.testing.assert_close(again.drafter.forward_train(ids).logits, want, rtol=0, atol=1e-5)


def test_kd_adds_target_kl(train_target, target, train_data, draft_dir, batches):
    obj = make(train_target, target, train_data.vocab, draft_dir, kd_weight=0.5).eval()
    assert obj.feature_spec() == FeatureSpec(hidden=True)
    assert make(train_target, target, train_data.vocab, draft_dir).feature_spec() == FeatureSpec()
    with torch.no_grad():
        out = obj(batches[0])
        pb, logits = obj.draft_logits(batches[0], cod_selection(128, 3))
        p = torch.log_softmax(target.lm_head(batches[0]["hidden"][:, pb.index]), -1)
        kl = (p.exp() * (p - torch.log_softmax(logits, -1))).sum(-1)
    kd = (kl * pb.valid).sum() / pb.valid.sum()
    assert out.metrics["loss/kd"].item() == pytest.approx(kd.item(), rel=1e-4)
    assert out.loss.item() == pytest.approx(out.metrics["loss/ce"].item() + 0.5 * kd.item(),
                                            rel=1e-5)




def test_training_lowers_loss_and_metrics(train_target, target, train_data, draft_dir, batches):
    obj = make(train_target, target, train_data.vocab, draft_dir).eval()
    with torch.no_grad():
        before = [obj(b) for b in batches]
    adam_steps(obj, batches, 30)
    with torch.no_grad():
        after = [obj(b) for b in batches]
    loss = [sum(o.loss.item() for o in outs) for outs in (before, after)]
    assert loss[1] < 0.7 * loss[0], loss
    m = after[0].metrics
    assert set(m) >= {"acc_0", "acc_2", "full_acc_2", "loss/copy_1", "acceptance_length_est"}
    assert m["full_acc_0"] == m["acc_0"] and m["full_acc_1"] <= m["acc_1"]
    est = 1 + sum(m[f"full_acc_{j}"] for j in range(3))
    assert m["acceptance_length_est"].item() == pytest.approx(est.item())


def test_engine_greedy_equality(tmp_path, train_target, target, train_data, draft_dir, batches):
    """Trained on the target's own greedy continuations, the export is served by draftsmith's
    engine as draft_model + parallel_drafting: output identical to no speculation, and drafts
    are accepted about as often as the training metrics predict (a misaligned layout would
    accept next to nothing)."""
    prompts, params, base, batch = own_continuations(train_target, batches, train_data.tokenizer)
    obj = adam_steps(make(train_target, target, train_data.vocab, draft_dir), [batch], 60,
                      lr=1e-2)
    with torch.no_grad():
        estimate = obj(batch).metrics["acceptance_length_est"].item()
    path = obj.export(tmp_path / "pard")
    spec = obj.speculative_config(path, 3)
    assert spec == {"method": "draft_model", "model": str(path), "parallel_drafting": True,
                    "num_speculative_tokens": 3}
    llm = LLM(train_target, speculative_config=spec, max_num_seqs=3)
    assert llm.proposer.mask_id == obj.mask_token_id
    assert [o.token_ids for o in llm.generate(prompts, params)] == base
    served = llm.get_metrics()["mean_acceptance_length"]
    assert estimate > 1.8 and served > 1.8, (estimate, served)


def test_registered(train_target, target, train_data, draft_dir):
    assert isinstance(make(train_target, target, train_data.vocab, draft_dir), PardObjective)
