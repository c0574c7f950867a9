"""The unlikelihood phase of the tiny-target build (train/tiny/unlikelihood.py)."""

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from train.tiny.quality import greedy_repetition
from train.tiny.unlikelihood import (UnlikelihoodSpec, finetune, repeated_ngram_mask,
                                     unlikelihood_loss)


def test_repeated_ngram_mask_marks_every_token_of_a_repeat():
    row = [1, 2, 3, 4, 9, 1, 2, 3, 4, 5]  # 1 2 3 4 recurs at 5..8
    mask = repeated_ngram_mask(torch.tensor([row, list(range(10))]), n=4)
    assert mask[0].tolist() == [False] * 5 + [True] * 4 + [False]
    assert not mask[1].any()


def test_unlikelihood_loss_is_minus_log_one_minus_p_on_negatives():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    tokens = torch.tensor([[0, 1, 2], [3, 4, 0]])
    neg = torch.tensor([[True, False, False], [False, True, True]])
    p = logits.softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    expected = -(torch.log(1 - p) * neg).sum() / 6
    loss = unlikelihood_loss(logits, tokens, neg)
    assert torch.allclose(loss, expected)
    loss.backward()  # descending it lowers p where negative, and only there
    with torch.no_grad():
        p2 = (logits - 1.0 * logits.grad).softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert (p2[neg] < p[neg]).all()


def test_finetune_breaks_greedy_loops_of_a_looping_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128, pad_token_id=0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(pad_token_id=0)
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(1, 32, (16, 32), generator=gen)  # real text: no loops
    loops = torch.randint(1, 32, (16, 4), generator=gen).repeat(1, 8)  # [16, 32] periodic
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(30):  # teach it to continue a loop
        model(input_ids=loops, labels=loops).loss.backward()
        opt.step()
        opt.zero_grad()
    before = greedy_repetition(model, rows, prompts=4, prefix=6, new_tokens=24)
    stats = finetune(model, rows, UnlikelihoodSpec(steps=25, lr=1e-2, prefix_tokens=6,
                                                   new_tokens=24), seed=0, progress=False)
    after = greedy_repetition(model, rows, prompts=4, prefix=6, new_tokens=24)
    assert before > 0.5 and after < before - 0.3, (before, after)
    assert stats["steps"] == 25 and stats["curve_step_mle_ul_negatives"]
