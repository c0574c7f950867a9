"""The end-of-training evaluation renders its prompts as the training data was rendered, and
compares the methods the default recipe names at the ks it names."""

import pytest
from omegaconf import OmegaConf

from train.config import TrainConfig
from train.evaluate import eval_prompts, harness_configs

from .conftest import thinking_target
from .test_config import compose_train


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


def test_default_recipe_compares_every_method_at_its_best_k(tmp_path):
    """`python train.py`'s evaluation (the tiny_eagle3 recipe): the trained head at k = 1, 3,
    5, n-gram and suffix decoding at 3 and 5 (each where its best k lies), the untrained draft
    LM, a reference row, at k = 3 only."""
    cfg = OmegaConf.to_object(compose_train([]))
    draft = tmp_path / "t-draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    configs = harness_configs(cfg, {"method": "eagle3", "model": "head"}, str(tmp_path / "t"))
    ks = {}
    for c in configs:
        ks.setdefault(c.method, set()).add(c.k)
    assert ks == {"tiny_eagle3": {1, 3, 5}, "ngram": {3, 5}, "suffix": {3, 5},
                  "draft_model": {3}}
    assert {(c.temperature, c.batch_size) for c in configs} == {(0.0, 1), (0.0, 8), (1.0, 1),
                                                                (1.0, 8)}


def test_summary_says_when_the_machine_changed_speed_within_a_cell():
    """The end-of-training table flags a cell whose autoregressive runs before and after
    differ by more than DRIFT_WARN, and only that cell."""
    from infer.eval.results import Baseline, HarnessReport
    from train.evaluate import summary

    moved = Baseline(1, 0.0, 300.0, 64, 0.2, 64, 0.003, tok_s_after=220.0)
    steady = Baseline(8, 0.0, 1000.0, 64, 0.06, 8, 0.008, tok_s_after=1040.0)
    lines = summary(HarnessReport("t", {}, [moved, steady], [], [], {}, "now")).splitlines()
    assert "moved -27% within the cell" in lines[1]
    assert lines[2].endswith("1040.0 after")
