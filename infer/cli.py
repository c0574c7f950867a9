"""What ``python infer.py`` does once Hydra has composed its config: read prompts, generate,
print outputs and a metrics table, write results as jsonl (atomically); with ``mode=eval`` run
the acceptance harness over the ``eval`` matrix (``run_eval``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from infer.foundation.atomic import remove_leftovers, write_text
from infer.config import InferConfig, Mode
from infer.data_sources import load_source
from infer.engine import LLM
from infer.foundation.errors import (FileFormatError, MissingFileError, NotWritableError,
                                     check_writable)
from infer.foundation.files import load_tokenizer
from infer.metrics import SpecMetrics
from infer.sampling import SamplingParams
from infer.foundation.validation import check_choice


def check_mode(cfg: InferConfig) -> Mode:
    return check_choice("mode", cfg.mode, Mode, "infer.py")


def check_outputs(cfg: InferConfig) -> None:
    """Where this mode writes (``output`` for generate, ``eval.output_dir`` for eval) can be
    written: checked before any model loads, so a long run never ends by losing its results."""
    mode = check_mode(cfg)
    if mode == "eval":
        check_writable(cfg.eval.output_dir or "outputs/eval", "eval.output_dir")
    elif mode == "generate" and cfg.output:
        if Path(cfg.output).is_dir():
            raise NotWritableError(f"output={cfg.output!r} is a directory; give a file path "
                                   "(results are written as jsonl)")
        check_writable(cfg.output, "output")


def read_prompts(path: str) -> list[Any]:
    """jsonl / json records with ``prompt_token_ids`` or ``prompt`` (read by the shared dataset
    reader), or text lines, one prompt each (``\\n`` in a line stands for a newline)."""
    p = Path(path)
    if not p.is_file():
        raise MissingFileError(f"prompts_file={path!r} does not exist")
    if p.suffix not in (".jsonl", ".json"):
        lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
        return [ln.replace("\\n", "\n") for ln in lines]
    prompts = []
    for n, record in enumerate(load_source(p), 1):
        value = record.get("prompt_token_ids")
        value = record.get("prompt") if value is None else value
        if value is None:
            raise FileFormatError(f"{path}: record {n}: expected 'prompt' or 'prompt_token_ids'; "
                             f"got keys {sorted(record)}")
        prompts.append(value)
    return prompts


def metrics_table(metrics: SpecMetrics, tok_s: float, k: int) -> str:
    rates = " ".join(f"{r:.2f}" for r in metrics.per_position_rates) or "-"
    rows = [("tokens/s", f"{tok_s:.1f}"), ("k", str(k)), ("drafts", str(metrics.num_drafts)),
            ("draft tokens", str(metrics.num_draft_tokens)),
            ("accepted tokens", str(metrics.num_accepted_tokens)),
            ("acceptance rate", f"{metrics.acceptance_rate:.3f}"),
            ("mean acceptance length", f"{metrics.mean_acceptance_length:.3f}"),
            ("per-position rates", rates)]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"| {name:<{width}} | {value} |" for name, value in rows)


def make_llm(cfg: InferConfig, model: str) -> LLM:
    """The engine every mode but eval runs (eval builds one per matrix row)."""
    return LLM(model, speculative_config=cfg.speculative_config, dtype=cfg.dtype,
               device=cfg.device, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
               seed=cfg.seed, tokenizer=cfg.tokenizer, num_threads=cfg.num_threads)


def run(cfg: InferConfig, model: str, prompts: list[Any]) -> list[dict]:
    """Generate for ``prompts`` with ``model``; print outputs and metrics; return result rows."""
    check_outputs(cfg)
    params = SamplingParams.from_dict(cfg.sampling)
    llm = make_llm(cfg, model)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    rows = [{"prompt": o.prompt, "prompt_token_ids": o.prompt_token_ids, "text": o.text,
             "token_ids": o.token_ids, "finish_reason": o.finish_reason, "error": o.error,
             "metrics": o.metrics} for o in outputs]
    if cfg.show_outputs:
        for o in outputs:
            print(f"=== prompt {o.request_id} ({o.finish_reason}) ===")
            print((o.prompt or str(o.prompt_token_ids))[-300:], end="")
            print(" ||| " + (o.text or str(o.token_ids) if o.error is None
                             else f"refused: {o.error}"))
    generated = sum(len(o.token_ids) for o in outputs)
    spec = llm.spec.to_json() if llm.spec else "none (autoregressive)"
    print(f"\nspeculative_config: {spec}")
    print(metrics_table(llm.metrics, generated / max(elapsed, 1e-9), llm.k))
    if cfg.output:
        remove_leftovers(cfg.output)  # of a killed earlier write
        write_text(cfg.output, "".join(json.dumps(row) + "\n" for row in rows))
        print(f"wrote {len(rows)} results to {cfg.output}")
    return rows


def run_serve(cfg: InferConfig, model: str) -> None:
    """mode=serve: the OpenAI-compatible server until Ctrl-C / SIGTERM (infer/serve/)."""
    from infer.serve.server import check_port, start_server

    s = cfg.serve
    check_port(s.host, s.port)  # before the model loads
    llm = make_llm(cfg, model)
    with start_server(llm, host=s.host, port=s.port, model_name=s.served_model_name or model,
                      log_level=str(s.log_level.value),
                      spec_stats=str(s.per_request_spec_decode_metrics.value)) as server:
        spec = llm.spec.to_json() if llm.spec else "none (autoregressive)"
        print(f"draftsmith serving {server.served.name!r} at {server.url}/v1 "
              f"(speculative_config: {spec}; metrics at {server.url}/metrics; Ctrl-C stops)",
              flush=True)
        server.wait()


# ---- mode=eval ----------------------------------------------------------------------------------

def with_default_head(methods: list[dict], head, name: str = "tiny_eagle3") -> list[dict]:
    """Add a recipe's trained EAGLE-3 head (when ``head`` is a path) to the matrix, labelled
    ``name`` (the recipe: the default one, or a named real target's)."""
    if head is None or any(m.get("model") == str(head) for m in methods):
        return methods
    from infer.drafters.common import token_map_entry

    return methods + [{"method": "eagle3", "model": str(head), "name": name,
                       **token_map_entry(head)}]


def eval_prompts(cfg: InferConfig, model: str, default: list[Any] | None) -> list[Any]:
    """``eval.dataset``, else the prompts the entry point passed (the held-out prompts of the
    embedded or named target); infer/eval/prompt_sets.py:eval_prompts says how."""
    from infer.eval.prompt_sets import eval_prompts as render

    tokenizer = load_tokenizer(cfg.tokenizer or model, required=cfg.tokenizer is not None)
    return render(cfg.eval, tokenizer, default, cfg.eval.chat_template_kwargs)


def run_eval(cfg: InferConfig, model: str, prompts: list[Any]):
    """The acceptance harness over ``cfg.eval``; prints the markdown report, returns it."""
    from dataclasses import asdict

    from infer.eval.harness import expand_matrix, run_harness
    from infer.eval.report import render_markdown
    from infer.foundation.tracking import make_logger

    check_outputs(cfg)
    ev = cfg.eval
    configs = expand_matrix(ev.methods, ev.ks, ev.temperatures, ev.batch_sizes)
    out = Path(ev.output_dir or Path("outputs/eval") / time.strftime("%Y-%m-%d_%H-%M-%S"))
    logger = make_logger(ev.logger, rank=int(os.environ.get("RANK", "0")),
                         project=ev.wandb_project, name=ev.wandb_run_name,
                         config={**asdict(cfg), "model": model}, dir=out, job_type="eval")
    try:
        options = ev.harness_options(device=cfg.device, dtype=cfg.dtype, seed=cfg.seed,
                                     max_model_len=cfg.max_model_len,
                                     num_threads=cfg.num_threads)
        report = run_harness(model, configs, prompts, options, output_dir=out, logger=logger)
    finally:
        logger.finish()
    print(render_markdown(report))
    print(f"wrote {out / 'results.json'}, results.md and plots")
    if not report.lossless:
        print("LOSSLESS CHECK FAILED: see results.md")
    return report
