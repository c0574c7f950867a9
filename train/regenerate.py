"""Self-distillation data: the target rewrites every assistant answer with its own output.

A drafter is judged on how well it predicts *the target*, not the dataset's authors, so the best
training answers are the target's own (EAGLE-3, SpecForge and the MLP speculator's stage 2 all
regenerate). Answers come from draftsmith's engine (``infer.LLM``: continuous batching of up to
``regenerate.batch_size`` requests, greedy or sampled with ``temperature`` / ``top_p``).

- a request's prompt is the chat template with the generation prompt, tokenised exactly as
  ``train/data_formats.py`` tokenises conversations (BOS added only when the template lacks it);
- multi-turn conversations go turn by turn: turn ``j`` sees the earlier answers already
  regenerated (as in a real conversation with the target); the ``j``-th turns of all
  conversations of a chunk are batched together;
- prompt/completion rows: the prompt as the pipeline renders it (a user turn, or TRL's message
  lists) is answered; only the completion's assistant turns are rewritten;
- ``text`` rows have no prompt to answer and are refused.

The answer is what the target emitted minus its stop token (EOS, or the template's turn
terminator, made a stop token too, so a config whose EOS is not the terminator, e.g. Llama 3's
``<|end_of_text|>`` vs ``<|eot_id|>``, still ends the turn); the template re-adds the terminator
when the data is tokenised. Answers cut by ``max_tokens`` are kept, counted and listed in the
row's ``truncated_turns`` column (message indices), so the data pipeline trains them without an
invented terminator; rows the pipeline cannot use and answers whose prompt exceeds
``max_model_len`` are kept unchanged. ``template_kwargs`` (``enable_thinking``) reach the chat
template here exactly as in the data pipeline and the evaluation prompts.

``out_dir`` holds ``chunk_NNNNN.jsonl`` (input format, same columns, answers replaced; each
written atomically when its chunk completes, so a rerun resumes at the missing chunks, after
deleting what a killed write left behind; the
sampling RNG is re-seeded per chunk, so resumed data equals an uninterrupted run's),
``stats.json`` (per-chunk counts) and ``dataset/`` (the combined ``save_to_disk`` folder, written
atomically last; ``load_source`` reads it). ``fingerprint.json`` records the inputs (target,
settings, dataset digest): a rerun into the same ``out_dir`` with other inputs is an error
naming the field; delete ``out_dir`` (or use another) to start over. The device type is
recorded (CPU answers in float32 and CUDA ones in the checkpoint's dtype differ), and so is
``batch_size`` when answers are sampled (``batch_size_matters``); a greedy ``batch_size`` only
changes speed and is not.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import datasets
from tqdm.auto import tqdm

from infer.foundation.atomic import atomic_dir, remove_leftovers, write_text
from infer.foundation.validation import check_int
from train import fingerprint
from train.config import validate_section
from train.data_formats import (TRUNCATED_COLUMN, SkipRow, added_special_tokens, detect_format,
                                render, row_to_messages)

_WHERE = "regenerate"
_VERSION = 4  # 3: truncated_turns column, template_kwargs; 4: device, sampled batch_size
_TARGET_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


# ----------------------------------------------------------------------------- fingerprint

def _dataset_digest(dataset: datasets.Dataset) -> str:
    """Content hash of the rows (datasets' own ``_fingerprint`` is random for in-memory data)."""
    h = hashlib.sha256()
    for batch in dataset.with_format(None).iter(batch_size=1024):
        h.update(json.dumps(batch, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def _target_digest(target_dir: str) -> str:
    """Config, tokenizer and template contents plus weight file sizes (not contents: 16 GB)."""
    root, h = Path(target_dir), hashlib.sha256()
    for name in _TARGET_FILES:
        if (root / name).is_file():
            h.update(name.encode() + (root / name).read_bytes())
    for p in sorted(root.glob("*.safetensors")):
        h.update(f"{p.name}:{p.stat().st_size}".encode())
    return h.hexdigest()[:16]


def batch_size_matters(cfg) -> bool:
    """Whether ``cfg.batch_size`` changes the answers: when they are sampled. One generator,
    re-seeded per chunk, feeds every running request, so another batch size hands each request
    other random numbers (every answer of a sampled run changes); greedy answers came out
    token-identical at batch 1 and 8 on the tiny target."""
    return float(cfg.temperature) > 0


def inputs_fingerprint(dataset: datasets.Dataset, target_dir: str, cfg, fmt: str, seed: int,
                       chunk_size: int, template_kwargs: dict[str, Any],
                       device: str = "cpu") -> dict[str, Any]:
    """Everything that changes the regenerated rows (a resumed run must match all of it);
    ``device``: the engine's device type."""
    return {"version": _VERSION, "template_kwargs": dict(sorted(template_kwargs.items())),
            "target_dir": str(Path(target_dir).resolve()),
            "target_files": _target_digest(target_dir), "temperature": float(cfg.temperature),
            "top_p": float(cfg.top_p), "max_tokens": int(cfg.max_tokens),
            "max_model_len": cfg.max_model_len, "format": fmt, "seed": seed,
            "chunk_size": chunk_size, "rows": len(dataset),
            "rows_digest": _dataset_digest(dataset), "device": device,
            "batch_size": int(cfg.batch_size) if batch_size_matters(cfg) else None,
            **({"engine": "vllm"} if str(cfg.engine) == "vllm" else {})}


def _check_fingerprint(out_dir: Path, fp: dict[str, Any]) -> None:
    path = out_dir / "fingerprint.json"
    if not path.exists():
        write_text(path, json.dumps(fp, indent=2))
        return
    saved = json.loads(path.read_text())
    reuse = (f" To train on them, set regenerate.seed={saved['seed']}."
             if saved.get("seed") != fp["seed"] else "")
    fingerprint.check(saved, fp, keys=list(fp), subject=f"{_WHERE}: {out_dir}",
                      held="its answers have",
                      remedy=f"Delete {out_dir} (or use another directory) to regenerate from "
                             f"scratch.{reuse}")


# ----------------------------------------------------------------------------- rows <-> jobs

@dataclass
class Job:
    """One row's conversation and the message indices to rewrite, in turn order."""

    messages: list[dict[str, str]]
    todo: list[int]
    done: dict[int, str] = field(default_factory=dict)
    truncated: list[int] = field(default_factory=list)  # indices whose answer hit max_tokens


def make_job(row: dict[str, Any], fmt: str) -> Job | None:
    """None for rows the data pipeline would skip anyway (they are written back unchanged)."""
    try:
        messages = row_to_messages(row, fmt)
    except SkipRow:
        return None
    first = _prompt_turns(row) if fmt == "prompt_completion" else 0  # given, not generated
    todo = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first]
    return Job(messages, todo) if todo else None


def _prompt_turns(row: dict[str, Any]) -> int:
    return len(row["prompt"]) if isinstance(row["prompt"], list) else 1  # TRL lists or a string


def _set_content(message: dict[str, Any], text: str) -> None:
    parts = message.get("content")  # OpenAI content parts stay a list of parts
    message["content"] = [{"type": "text", "text": text}] if isinstance(parts, list) else text


def write_back(row: dict[str, Any], fmt: str, job: Job | None) -> dict[str, Any]:
    """``row`` (a copy) with the regenerated answers in place of the originals and the
    indices of those cut by ``max_tokens`` in ``TRUNCATED_COLUMN``."""
    row = copy.deepcopy(row)
    row[TRUNCATED_COLUMN] = list(job.truncated) if job else []
    for i, text in (job.done if job else {}).items():
        if fmt == "openai":
            _set_content(row["messages"][i], text)
        elif fmt == "sharegpt":
            row["conversations"][i]["value"] = text
        elif isinstance(row["completion"], list):
            _set_content(row["completion"][i - _prompt_turns(row)], text)
        else:
            row["completion"] = text
    return row


# ----------------------------------------------------------------------------- generation

@dataclass
class Counts:
    answers: int = 0  # regenerated
    tokens: int = 0  # generated tokens
    truncated: int = 0  # answers that hit max_tokens
    kept: int = 0  # answers kept because their prompt was too long or the template failed
    rows_skipped: int = 0  # rows the data pipeline cannot use (written back unchanged)

    def add(self, other: "Counts") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


def _terminator(tokenizer, template_kwargs: dict[str, Any]) -> str:
    """The text the chat template writes right after an answer (``<|eot_id|>``, ...), or ""."""
    marker = "\x1fANSWER\x1f"
    try:
        user = [{"role": "user", "content": "hi"}]
        full = render(tokenizer, user + [{"role": "assistant", "content": marker}],
                      **template_kwargs)
    except Exception:  # noqa: BLE001 - a template that needs other roles: no terminator known
        return ""
    at = full.find(marker)
    return full[at + len(marker):].rstrip() if at >= 0 else ""


class Regenerator:
    """One engine over the target; ``rewrite(jobs)`` fills each job's ``done`` answers."""

    def __init__(self, target_dir: str, cfg, seed: int, device: str,
                 template_kwargs: dict[str, Any] | None = None, context: int | None = None):
        from infer.foundation.files import load_tokenizer
        from infer.models.foreign import engine_gap

        from infer import LLM, SamplingParams

        self.tokenizer = tok = load_tokenizer(target_dir, key="target.path")
        if not tok.chat_template:
            raise ValueError(f"{_WHERE}: the tokenizer of {target_dir} has no chat_template; "
                             "regeneration renders prompts with it")
        max_len = cfg.max_model_len or _context_len(target_dir, context)
        if str(cfg.engine) == "vllm":  # one vLLM for the whole rewrite
            from infer.eval.vllm_engine import VllmSession

            self.llm = VllmSession(target_dir, python=cfg.vllm_python,
                                   max_num_seqs=cfg.batch_size, max_model_len=max_len,
                                   tensor_parallel_size=cfg.tensor_parallel_size, seed=seed)
        elif (gap := engine_gap(target_dir)) is not None:  # any causal LM transformers ships
            from infer.eval.transformers_session import TransformersSession

            print(f"regeneration through transformers' generate (draftsmith's engine does not "
                  f"run the target: {gap}; regenerate.engine=vllm serves it faster)", flush=True)
            self.llm = TransformersSession(target_dir, max_num_seqs=cfg.batch_size,
                                           max_model_len=max_len, device=device, seed=seed)
        else:
            self.llm = LLM(target_dir, max_num_seqs=cfg.batch_size, max_model_len=max_len,
                           seed=seed, device=device)
        self.added = added_special_tokens(tok)
        self.template_kwargs = dict(template_kwargs or {})
        self.terminator = _terminator(tok, self.template_kwargs)
        term_ids = tok(self.terminator, add_special_tokens=False)["input_ids"]
        stop = term_ids if len(term_ids) == 1 else []  # a one-token terminator stops generation
        self.stop_ids = set(self.llm.eos_ids) | set(stop)
        self.params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                     max_tokens=cfg.max_tokens, stop_token_ids=stop)
        self.piece = 16 * cfg.batch_size  # requests per generate call (progress granularity)

    def close(self) -> None:
        """Stop a vLLM session (draftsmith's engine needs nothing)."""
        if hasattr(self.llm, "close"):
            self.llm.close()

    def prompt_ids(self, history: list[dict[str, str]]) -> list[int]:
        """Token ids exactly as ``data_formats.tokenize_messages`` tokenises the same prefix."""
        text = render(self.tokenizer, history, True, **self.template_kwargs)
        add = bool(self.added) and not all(t in text for t in self.added)
        return self.tokenizer(text, add_special_tokens=add)["input_ids"]

    def answer(self, completion) -> str:
        """Generated ids -> answer text without the stop token (the template re-adds it)."""
        ids = list(completion.token_ids)
        if completion.finish_reason == "stop" and ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)
        if self.terminator and text.endswith(self.terminator):  # a multi-token terminator
            text = text[: -len(self.terminator)]
        return text

    def rewrite(self, jobs: list[Job | None], chunk_seed: int,
                progress: Callable[[int, int], None] = lambda answers, tokens: None) -> Counts:
        """Turn by turn: the ``turn``-th answers of all live jobs, in batched generate calls.

        ``progress(answers, tokens)`` after each call (answers kept unchanged count as done).
        """
        self.llm.generator.manual_seed(chunk_seed)  # chunk output independent of earlier chunks
        counts, live, turn = Counts(), [j for j in jobs if j], 0

        def give_up(job: Job) -> int:  # keep this and later answers of ``job`` unchanged
            n, job.todo = len(job.todo) - turn, job.todo[:turn]
            counts.kept += n
            return n

        while live:
            requests = []  # (job, message index, prompt ids)
            for job in live:
                i = job.todo[turn]
                try:
                    requests.append((job, i, self.prompt_ids(job.messages[:i])))
                except Exception:  # noqa: BLE001 - the template rejects this history
                    progress(give_up(job), 0)
            for s in range(0, len(requests), self.piece):
                piece = requests[s:s + self.piece]
                outs = self.llm.generate([ids for _, _, ids in piece], self.params)
                done = tokens = 0
                for (job, i, _), out in zip(piece, outs):
                    if out.error:  # prompt does not fit max_model_len: later turns won't either
                        done += give_up(job)
                        continue
                    job.done[i] = job.messages[i]["content"] = self.answer(out.outputs[0])
                    counts.answers, done = counts.answers + 1, done + 1
                    tokens += len(out.outputs[0].token_ids)
                    if out.finish_reason == "length":
                        counts.truncated += 1
                        job.truncated.append(i)
                counts.tokens += tokens
                progress(done, tokens)
            turn += 1
            live = [j for j in live if turn < len(j.todo)]
        return counts


# ----------------------------------------------------------------------------- entry point

def _context_len(target_dir: str, context: int | None) -> int | None:
    """``regenerate.max_model_len`` unset: ``context`` (what training keeps of a row plus one
    answer) within the target's positions, so 32 rows do not reserve a KV cache for the model's
    whole context (SmolLM2: 8,192 positions, engine-capped at 4,096: ~6 GB); None: the engine's
    default."""
    if context is None:
        return None
    from infer.models.foreign import target_config

    return min(context, target_config(target_dir).max_position_embeddings)


def _chunk_path(out_dir: Path, i: int) -> Path:
    return out_dir / f"chunk_{i:05d}.jsonl"


def regenerate(dataset: datasets.Dataset, target_dir: str, cfg, out_dir: str | Path, *,
               format: str | None = None, seed: int = 0, device: str = "auto",
               progress: bool = True, chunk_size: int = 256,
               template_kwargs: dict[str, Any] | None = None,
               context: int | None = None) -> datasets.Dataset:
    """``dataset`` (same format, its columns plus ``TRUNCATED_COLUMN``) with every assistant
    answer written by the target; resumes from the chunks already in ``out_dir`` (see the module
    doc). ``context``: the engine's length when ``cfg.max_model_len`` is unset (the pipeline:
    ``data.max_length + max_tokens``)."""
    validate_section("regenerate", cfg)  # a RegenerateConfig
    check_int("chunk_size", chunk_size, _WHERE, minimum=1)
    fmt = detect_format(dataset.column_names, format)
    if fmt == "text":
        raise ValueError(f"{_WHERE}: format 'text' has no prompts to answer (columns "
                         f"{dataset.column_names}); regeneration needs a chat (openai, sharegpt) "
                         "or prompt_completion dataset, or regenerate.enabled=false")
    out_dir = Path(out_dir)
    remove_leftovers(out_dir / "*")  # killed writes'; the pipeline runs this on one rank at a time
    kwargs = dict(template_kwargs or {})
    from infer.target import resolve_device

    _check_fingerprint(out_dir, inputs_fingerprint(dataset, target_dir, cfg, fmt, seed, chunk_size,
                                                   kwargs, resolve_device(str(device)).type))
    final = out_dir / "dataset"
    if final.is_dir():
        return datasets.load_from_disk(str(final))
    n_chunks = -(-len(dataset) // chunk_size)
    missing = [i for i in range(n_chunks) if not _chunk_path(out_dir, i).exists()]
    if missing:
        gen = Regenerator(target_dir, cfg, seed, device, kwargs, context)
        try:
            _generate_chunks(dataset, gen, out_dir, fmt, seed, progress, chunk_size, missing)
        finally:
            gen.close()
    elif progress:
        print(f"{_WHERE}: all {n_chunks} chunks already in {out_dir}", flush=True)
    return _combine(out_dir, n_chunks, dataset.features)


def _generate_chunks(dataset, gen: Regenerator, out_dir: Path, fmt: str, seed: int, show: bool,
                     chunk_size: int, missing: list[int]) -> None:
    def rows(i: int) -> list[dict]:
        return list(dataset.select(range(i * chunk_size, min((i + 1) * chunk_size,
                                                             len(dataset)))).with_format(None))

    total = sum(len(j.todo) for i in missing for j in (make_job(r, fmt) for r in rows(i)) if j)
    stats_path = out_dir / "stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    run, live, start = Counts(), Counts(), time.perf_counter()
    bar = tqdm(total=total, desc=_WHERE, unit="answer", disable=not show, dynamic_ncols=True)

    def tick(answers: int, tokens: int) -> None:  # answers/s and ETA by tqdm, tokens/s here
        live.tokens += tokens
        bar.update(answers)
        bar.set_postfix(tok_s=f"{live.tokens / max(time.perf_counter() - start, 1e-9):.0f}")

    try:
        for i in missing:
            raw = rows(i)
            jobs = [make_job(r, fmt) for r in raw]
            counts = gen.rewrite(jobs, chunk_seed=seed * 1_000_003 + i, progress=tick)
            counts.rows_skipped = sum(j is None for j in jobs)
            run.add(counts)
            write_text(_chunk_path(out_dir, i), "".join(
                json.dumps(write_back(r, fmt, j), ensure_ascii=False, default=str) + "\n"
                for r, j in zip(raw, jobs)))
            stats[str(i)] = asdict(counts)
            write_text(stats_path, json.dumps(stats, indent=1))
    finally:
        bar.close()
    seconds, every = time.perf_counter() - start, Counts()
    for c in stats.values():
        every.add(Counts(**c))
    print(f"{_WHERE}: {every.answers} answers ({run.answers} this run, {run.tokens} tokens, "
          f"{run.tokens / max(seconds, 1e-9):.0f} tok/s), {every.truncated} hit "
          f"max_tokens={gen.params.max_tokens}, {every.kept} kept (prompt longer than "
          f"max_model_len or rejected by the template), {every.rows_skipped} rows unusable -> "
          f"{out_dir}", flush=True)


def _combine(out_dir: Path, n_chunks: int, features: datasets.Features) -> datasets.Dataset:
    """Chunks -> one ``save_to_disk`` folder with the input's features, replaced atomically."""
    rows = [json.loads(line) for i in range(n_chunks)
            for line in _chunk_path(out_dir, i).read_text(encoding="utf-8").split("\n") if line]
    features = datasets.Features({**features, TRUNCATED_COLUMN: datasets.List(
        datasets.Value("int32"))})
    ds = datasets.Dataset.from_dict({c: [r.get(c) for r in rows] for c in features},
                                    features=features)
    with atomic_dir(out_dir / "dataset") as tmp:
        ds.save_to_disk(str(tmp))
    return datasets.load_from_disk(str(out_dir / "dataset"))
