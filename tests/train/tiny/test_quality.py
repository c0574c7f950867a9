"""The two numbers that say how much the embedded target is like a real one."""

import math

import pytest
import torch

from train.tiny.quality import repetition, unigram_loss


def test_repetition():
    assert repetition([1, 2, 3, 4, 5, 6]) == 0.0
    loop = [7, 8, 9] * 6  # 18 tokens, 15 4-grams, 3 distinct
    assert repetition(loop) == pytest.approx(1 - 3 / 15)
    assert repetition([1, 2, 3]) == 0.0  # no 4-gram at all
    assert repetition([1, 1, 1, 1, 1], n=2) == pytest.approx(0.75)


def test_unigram_loss_is_add_one_smoothed_frequencies():
    train = torch.tensor([[0, 0, 0, 1]])  # counts 3, 1, 0 (+1 each over a 3-token vocab)
    held = torch.tensor([[2, 0, 1, 2]])  # the first token of a row is never scored
    want = -(math.log(4 / 7) + math.log(2 / 7) + math.log(1 / 7)) / 3
    assert unigram_loss(train, held, 3) == pytest.approx(want)
