"""The end-of-training evaluation renders its prompts as the training data was rendered."""

import pytest

from train.config import TrainConfig
from train.evaluate import eval_prompts

from .conftest import thinking_target


def test_data_enable_thinking_reaches_the_eval_prompts(tmp_path, train_target):
    target = str(thinking_target(train_target, tmp_path / "target"))
    cfg = TrainConfig()
    cfg.eval.num_prompts = 3
    plain = eval_prompts(cfg, target)
    cfg.data.enable_thinking = False
    off = eval_prompts(cfg, target)
    assert [p + "# no thinking\n" for p in plain] == off
    cfg.eval.chat_template_kwargs = {"enable_thinking": True}
    with pytest.raises(ValueError, match="eval.chat_template_kwargs.enable_thinking=True "
                                         "contradicts data.enable_thinking=False"):
        eval_prompts(cfg, target)
