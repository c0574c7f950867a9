"""Train a drafter: ``python train.py [recipe=NAME] [key=value ...]`` (conf/train.yaml).

Thin entry: Hydra composes the typed config (train/config.py), train/pipeline.py runs it.
"""

import hydra
from omegaconf import OmegaConf

from train.config import TrainConfig, register_configs

register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="train")
def main(dcfg) -> None:
    from train.pipeline import run

    cfg: TrainConfig = OmegaConf.to_object(dcfg)
    run(cfg)


if __name__ == "__main__":
    main()
