"""Train a drafter: ``python train.py [recipe=NAME] [key=value ...]`` (conf/train.yaml).

Thin entry: Hydra composes the typed config (train/config.py), train/pipeline.py runs it.
A user error (config, file, value) prints one line and exits 2 (infer/foundation/entry.py).
"""

import hydra
from omegaconf import OmegaConf

from infer.foundation.entry import prepare_argv, user_errors
from train.config import TrainConfig, explain_method_keys, register_configs

register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="train")
def main(dcfg) -> None:
    with user_errors("train.py"):
        from train.pipeline import run

        cfg: TrainConfig = OmegaConf.to_object(dcfg)
        run(cfg)


if __name__ == "__main__":
    prepare_argv("train", "train.py", explain_method_keys)
    main()
