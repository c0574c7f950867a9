"""Generate with draftsmith's engine: ``python infer.py [key=value ...]`` (conf/infer.yaml).

With no ``model`` it uses the embedded tiny target (built on first use) on held-out code
prompts, drafting with the default recipe's trained EAGLE-3 head (outputs/tiny_eagle3/final)
when ``python train.py`` has produced it, else with the tiny draft LM, unless
``speculative_config`` says otherwise. ``model=smollm2`` serves the real target installed from
the package registry (train/real/targets.py) on held-out chat questions, with its recipe's head
when ``train.py recipe=smollm2_eagle3`` has made it.
``mode=eval`` runs the acceptance harness instead (``eval.*`` keys; infer/eval/harness.py);
``mode=serve`` an OpenAI-compatible HTTP server (``serve.*`` keys; infer/serve/).
A user error (config, file, value) prints one line and exits 2 (infer/foundation/entry.py).
"""

from pathlib import Path

import hydra
from omegaconf import OmegaConf

from infer.config import InferConfig, register_configs
from infer.foundation.entry import prepare_argv, user_errors
from infer.foundation.errors import ConfigError

register_configs()
DEFAULT_HEAD = Path("outputs") / "tiny_eagle3" / "final"  # train.py's default recipe output


def default_model(cfg: InferConfig) -> tuple[str, list | None]:
    """The embedded default: tiny target, held-out code prompts, and the default recipe's
    trained head (``python train.py`` -> outputs/tiny_eagle3/final) when it exists, else the
    tiny draft model (k=3)."""
    from train.tiny.build import ensure_tiny_target
    from train.tiny.corpus import default_draft_dir

    from infer.cli import with_default_head
    from infer.drafters.common import token_map_entry
    from infer.eval.methods import with_paired_draft

    target = str(ensure_tiny_target(with_draft=True))
    draft = str(default_draft_dir())
    head = DEFAULT_HEAD if (DEFAULT_HEAD / "config.json").is_file() else None
    if cfg.speculative_config is None:
        cfg.speculative_config = ({"method": "eagle3", "model": str(head),
                                   "num_speculative_tokens": 3, **token_map_entry(head)}
                                  if head else
                                  {"method": "draft_model", "model": draft,
                                   "num_speculative_tokens": 3})
    cfg.eval.methods = with_default_head(with_paired_draft(cfg.eval.methods, draft), head)
    if cfg.mode == "eval" and cfg.eval.dataset:
        return target, None
    from train.tiny.examples import heldout_prompts

    n = cfg.eval.prompts_needed() if cfg.mode == "eval" else cfg.num_prompts
    return target, heldout_prompts(n, seed=cfg.seed)


def named_model(cfg: InferConfig) -> tuple[str, list | None]:
    """A named real target (``model=smollm2``): its converted folder (converted on first use),
    the held-out chat questions as default prompts (``draftsmith:chat-heldout``, through the chat
    template), and its recipe's trained head when ``train.py recipe=smollm2_eagle3`` made it."""
    from train.real.targets import NAMED_TARGETS, local_target
    from train.tiny.corpus import existing_paired_draft

    from infer.cli import with_default_head
    from infer.drafters.common import token_map_entry
    from infer.eval.methods import with_paired_draft
    from infer.eval.chat_prompts import HELDOUT
    from infer.foundation.files import load_tokenizer

    recipe = NAMED_TARGETS[cfg.model].recipe
    head = Path("outputs") / recipe / "final"
    head = head if (head / "config.json").is_file() else None
    target = local_target(cfg.model)
    if cfg.speculative_config is None and head is not None:
        cfg.speculative_config = {"method": "eagle3", "model": str(head),
                                  "num_speculative_tokens": 3, **token_map_entry(head)}
    if cfg.mode == "eval":
        cfg.eval.dataset = cfg.eval.dataset or "draftsmith:chat-heldout"
        methods = with_paired_draft(cfg.eval.methods, existing_paired_draft(target))
        cfg.eval.methods = with_default_head(methods, head, recipe)
        return target, None
    tokenizer = load_tokenizer(target)
    return target, [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                  tokenize=False, add_generation_prompt=True)
                    for q in HELDOUT[: cfg.num_prompts]]


@hydra.main(version_base=None, config_path="conf", config_name="infer")
def main(dcfg) -> None:
    with user_errors("infer.py"):
        generate_or_eval(OmegaConf.to_object(dcfg))


def generate_or_eval(cfg: InferConfig) -> None:
    from infer.cli import check_outputs
    from infer.foundation.signals import raise_on_signals

    cfg.validate()  # every key, before the tiny target is built or a model loaded
    check_outputs(cfg)  # and where results go can be written
    with raise_on_signals("server stopped" if cfg.mode == "serve" else "no results were written"):
        _run(cfg)


def _run(cfg: InferConfig) -> None:
    from infer.cli import check_mode, eval_prompts, read_prompts, run, run_eval, run_serve

    mode = check_mode(cfg)
    from train.real.targets import NAMED_TARGETS

    if cfg.model in NAMED_TARGETS:
        model, prompts = named_model(cfg)
    else:
        model, prompts = (cfg.model, None) if cfg.model else default_model(cfg)
    if mode == "serve":
        run_serve(cfg, model)
        return
    if mode == "eval":
        run_eval(cfg, model, eval_prompts(cfg, model, prompts))
        return
    if cfg.prompts_file:
        prompts = read_prompts(cfg.prompts_file)
    if prompts is None:
        raise ConfigError("give prompts_file=... (text lines or jsonl) with model=...")
    run(cfg, model, prompts)


if __name__ == "__main__":
    prepare_argv("infer", "infer.py")
    main()
