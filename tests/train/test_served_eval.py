"""Served acceptance during training: the same number the engine gives the exported head."""

import pytest

from infer import LLM, SamplingParams
from train.frozen_target import FrozenTarget
from train.objectives.base import OBJECTIVES
from train.served_eval import ServedEval

from .objectives.test_eagle3 import make_cfg

PROMPTS = ["def add(a, b):\n", "for i in range(10):\n    pri", "class Point:\n"]


def test_values_are_the_engines_and_the_target_is_released_again(train_data, tmp_path):
    frozen = FrozenTarget(train_data.target_dir, "float32", "cpu")
    cfg = make_cfg("eagle3")
    objective = OBJECTIVES.get("eagle3")(cfg, frozen.heads, train_data.vocab,
                                         train_data.target_dir)
    served = ServedEval(2, objective, frozen, PROMPTS, k=3, max_tokens=12)
    values = served(objective.state_dict())
    assert not frozen.loaded  # offline training had released it: released again
    path = objective.export(tmp_path / "head")
    llm = LLM(train_data.target_dir, speculative_config=objective.speculative_config(path, 3),
              max_num_seqs=3)
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    metrics = llm.get_metrics()
    assert values["acceptance_length"] == pytest.approx(metrics["mean_acceptance_length"])
    assert [values[f"acceptance_rate_pos_{i}"] for i in range(3)] == pytest.approx(
        metrics["per_position_rates"])
    frozen.model  # online training holds the model: it stays
    served(objective.state_dict())
    assert frozen.loaded


def test_settings_are_checked(train_data):
    frozen = FrozenTarget(train_data.target_dir, "float32", "cpu")
    cfg = make_cfg("eagle3")
    objective = OBJECTIVES.get("eagle3")(cfg, frozen.heads, train_data.vocab,
                                         train_data.target_dir)
    assert ServedEval.from_config(cfg, objective, frozen) is None  # every_steps 0: off
    cfg.eval.every_steps = -1
    with pytest.raises(ValueError, match="eval.every_steps"):
        ServedEval.from_config(cfg, objective, frozen)
    cfg.eval.every_steps, cfg.eval.every_num_prompts = 5, 2
    served = ServedEval.from_config(cfg, objective, frozen)
    assert served.every_steps == 5 and len(served.prompts) == 2 and served.k == max(cfg.eval.ks)
