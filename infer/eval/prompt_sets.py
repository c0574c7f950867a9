"""Prompt sets for the acceptance harness: local files and Hugging Face datasets in common shapes.

``load_prompts(source, num=, split=, subset=, tokenizer=, chat=, field=)`` reads local .jsonl /
.json / .csv / .parquet / .arrow files, dataset folders and hub ids with the reader training data
uses (``infer.data_sources.load_source``). Each record yields one prompt
(``prompt_from_record``): ``prompt_token_ids`` (passed through), ``messages`` / ``conversations``
(OpenAI or ShareGPT turns up to the first user turn), ``turns`` (MT-bench, first turn),
``question`` (GSM8K), ``instruction`` (+ ``input``), ``prompt`` (HumanEval: plain text), ``text``.
Chat-style prompts go through the tokenizer's chat template (``render_prompt``).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from infer.data_sources import ROLES, load_source

log = logging.getLogger(__name__)

_CHAT_KEYS = ("messages", "conversations", "conversation")
PROMPT_FIELDS = (*_CHAT_KEYS, "turns", "question", "instruction", "prompt", "text")


def prompt_from_record(record: Mapping[str, Any], field: str | None = None) -> tuple[Any, bool]:
    """One record's prompt: (text or token ids, False) for completion-style records, (messages
    up to the first user turn, True) for chat-style ones. Shapes: messages / conversations
    (OpenAI or ShareGPT turns), turns (MT-bench: the first), question (GSM8K), instruction
    (+ input), prompt (HumanEval: plain text; a message list is chat), text."""
    keys = (field,) if field else PROMPT_FIELDS
    if not field and isinstance(record.get("prompt_token_ids"), list):
        return list(record["prompt_token_ids"]), False
    for key in keys:
        if key not in record or record[key] is None:
            continue
        value = record[key]
        if key in _CHAT_KEYS or (isinstance(value, list) and value
                                 and isinstance(value[0], Mapping)):
            return _first_user_turn(value), True
        if key == "turns":
            first = value[0] if isinstance(value, list) and value else value
            text = first.get("content", "") if isinstance(first, Mapping) else str(first)
            return [{"role": "user", "content": text}], True
        if key == "instruction":
            extra = record.get("input")
            text = f"{value}\n\n{extra}" if extra else str(value)
            return [{"role": "user", "content": text}], True
        if key == "question":
            return [{"role": "user", "content": str(value)}], True
        return str(value), False
    raise ValueError(f"record has no prompt field: expected one of {', '.join(keys)}; "
                     f"got keys {sorted(record)}")


def _first_user_turn(turns: Sequence[Any]) -> list[dict]:
    """Messages up to and including the first user turn, as {"role", "content"}."""
    out = []
    for turn in turns:
        role = ROLES.get(str(turn.get("role", turn.get("from", ""))).lower(), "user")
        content = turn.get("content", turn.get("value", ""))
        out.append({"role": role, "content": content})
        if role == "user":
            return out
    raise ValueError(f"conversation without a user turn: {list(turns)[:3]}")


def render_prompt(prompt: Any, is_chat: bool, tokenizer: Any = None, chat: bool | None = None,
                  template_kwargs: Mapping[str, Any] | None = None) -> str | list[int]:
    """The chat template with a generation prompt for chat-style prompts (``chat=None``) or all
    (``chat=True``) when the tokenizer has one; plain text otherwise. ``template_kwargs``
    (vLLM's ``chat_template_kwargs``, e.g. ``enable_thinking``) reach the template."""
    if not is_chat and not isinstance(prompt, str):
        return prompt  # token ids go to the engine as they are
    want = is_chat if chat is None else chat
    if want and getattr(tokenizer, "chat_template", None):
        messages = prompt if is_chat else [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **dict(template_kwargs or {}))
    if chat:
        log.warning("chat=True but the tokenizer has no chat template; using plain text")
    return "\n\n".join(m["content"] for m in prompt) if is_chat else prompt


def load_prompts(source: str, *, num: int | None = None, split: str = "test",
                 subset: str | None = None, tokenizer: Any = None, chat: bool | None = None,
                 field: str | None = None, template_kwargs: Mapping[str, Any] | None = None
                 ) -> list[str | list[int]]:
    """The first ``num`` prompts of a local .json / .jsonl file (a list of records, or an
    object holding one), a local .csv / .parquet file or dataset folder, or a Hugging Face hub
    dataset id (``split``, ``subset``), rendered by ``render_prompt``."""
    prompts = []
    for i, record in enumerate(load_source(source, split, subset=subset)):
        if num is not None and len(prompts) >= num:
            break
        if not isinstance(record, Mapping):
            raise ValueError(f"{source}: record {i} is {type(record).__name__}, not an object")
        try:
            prompt, is_chat = prompt_from_record(record, field)
        except ValueError as e:
            raise ValueError(f"{source}: record {i}: {e}") from None
        prompts.append(render_prompt(prompt, is_chat, tokenizer, chat, template_kwargs))
    if not prompts:
        raise ValueError(f"{source}: no prompts found")
    return prompts


def eval_prompts(ev: Any, tokenizer: Any, default: Sequence[Any] | None,
                 template_kwargs: Mapping[str, Any]) -> list[Any]:
    """The prompts of an evaluation (``ev``: an ``EvalConfig``), for both entry points:
    ``eval.dataset`` (chat template where a record is chat-style), else ``default`` (strings
    sent as one user message each through the chat template unless ``eval.chat=false``; token-id
    prompts pass through), the first ``ev.prompts_needed()``."""
    from infer.foundation.errors import ConfigError

    if ev.dataset:
        return load_prompts(ev.dataset, num=ev.prompts_needed(), split=ev.dataset_split,
                            subset=ev.dataset_subset, tokenizer=tokenizer, chat=ev.chat,
                            template_kwargs=dict(template_kwargs))
    if default is None:
        raise ConfigError("mode=eval: give eval.dataset=... (json/jsonl file, dataset "
                          "directory or hub id) with model=...")
    return [render_prompt([{"role": "user", "content": p}], True, tokenizer, ev.chat,
                          dict(template_kwargs)) if isinstance(p, str) else p
            for p in list(default)[: ev.prompts_needed()]]
