"""Conversation formats and assistant-only loss masks (any chat template); datasets are read by
``infer.data_sources.load_source`` (the reader evaluation prompts use too).

``train/data.py`` builds the training pipeline on top of these pieces; this module knows nothing
about packing or caching.

Loss masks without per-family regexes
-------------------------------------
For every assistant turn ``i`` the conversation prefix is rendered twice with the tokenizer's own
chat template: ``messages[:i]`` with ``add_generation_prompt=True`` (everything the model is given
before it starts answering) and ``messages[:i + 1]`` (the same plus the answer). The characters
between the two renders are the answer as the template writes it. The whole conversation is
rendered to text once and tokenised once with ``return_offsets_mapping``; a token is a loss
token when its character span overlaps an answer span. Tokenising once (instead of tokenising
each prefix) matters: BPE merges across a boundary can make the tokens of a prefix differ from
the first tokens of the full text, and offsets sidestep that entirely.

What is in the loss (decided here, once, for every template):

- the answer text and the turn terminator the template writes after it (``<|eot_id|>``,
  ``<|im_end|>``, ``<|end|>`` ...): the drafter has to predict the end of a turn, or it keeps
  proposing tokens the target will never emit;
- not the role header / generation prompt: it is given at inference, never generated;
- not the template's whitespace after the terminator (ChatML's and draftsmith's trailing
  ``"\\n"``): generation stops at the terminator, so nothing ever predicts it. Only whitespace at
  the very end of the answer span is dropped, so whitespace inside the answer, or before a
  terminator, stays. (A template with no terminator loses the answer's own trailing whitespace.)
- never the first token of a document (see ``train/data.py``): no in-document position precedes
  it, so nothing can predict it.

One example per conversation, or one per assistant turn
-------------------------------------------------------
A drafter must see every answer exactly as the target generated it and as serving will show it:
the prompt rendered with the generation prompt, then the answer tokens. When every
``messages[:i + 1]`` render is a prefix of the full render, the whole conversation is one
example and each answer in it sits in exactly that context. Templates that render an earlier
answer differently once later turns follow (Qwen3 strips the ``<think>`` block of every answer
before the last user message) break that property; the conversation then becomes one example
per assistant turn, ``messages[:i + 1]``, where the answer is the last turn and keeps what the
template keeps of it (its think block) while earlier answers appear as serving renders them.
Where even ``messages[:i]`` + generation prompt is not a prefix of ``messages[:i + 1]``, the
answer is located by its content (after the point where the two renders diverge) and extended
by the template text that follows it in both renders (the terminator).

Answers cut by ``max_tokens`` (regenerated answers listed in the row's ``truncated_turns``)
never ended: no terminator followed them, and a template re-rendering one cut inside its think
block writes something serving never produces (Qwen3 prepends an empty think block). Each
becomes its own example, the generation prompt followed by the answer text exactly as
generated, every answer token in the loss and no terminator; where the conversation goes on, it
is context of the later turns as the template renders it, not a target.

BOS: templates like Llama 3's write ``<|begin_of_text|>`` themselves and their tokenizers add it
too; the text is tokenised with ``add_special_tokens=False`` whenever the rendered text already
contains every special token the tokenizer would add, so BOS is never doubled.
"""

from __future__ import annotations

from typing import Any

from infer.data_sources import ROLES, load_source  # noqa: F401 (load_source: re-exported)
from infer.foundation.validation import config_error

# --------------------------------------------------------------------------------- formats

# format -> the columns it needs; detection tries them in this order
FORMATS: dict[str, tuple[str, ...]] = {
    "openai": ("messages",),            # [{"role": ..., "content": ...}, ...]
    "sharegpt": ("conversations",),     # [{"from": "human"|"gpt"|"system", "value": ...}, ...]
    "prompt_completion": ("prompt", "completion"),  # one user turn + one assistant turn
    "text": ("text",),                  # a plain document: every token is trained, no template
}
TRUNCATED_COLUMN = "truncated_turns"  # regenerated rows: message indices of answers cut short
FORMAT_HELP = ("sharegpt (conversations: from/value), openai (messages: role/content), "
               "prompt_completion (prompt + completion), text (text)")

def detect_format(columns: list[str], format: str | None = None) -> str:
    """The format of a dataset with ``columns``; ``format`` forces one (its columns checked)."""
    cols = sorted(columns)
    if format is not None:
        if format not in FORMATS:
            raise config_error("format", format, f"one of {sorted(FORMATS)} or None (auto)",
                               "data")
        missing = [c for c in FORMATS[format] if c not in columns]
        if missing:
            raise ValueError(f"data: format {format!r} needs columns {list(FORMATS[format])}, "
                             f"missing {missing}; the dataset has columns {cols}")
        return format
    for name, needed in FORMATS.items():
        if all(c in columns for c in needed):
            return name
    raise ValueError(f"data: cannot tell the format from the columns {cols}; supported formats: "
                     f"{FORMAT_HELP}; pass format=... to force one")


class SkipRow(Exception):
    """A row that cannot become a training example; ``reason`` is counted in the summary."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _content(value: Any) -> str:
    """Message content as text: None -> "", OpenAI content parts -> their text joined."""
    if value is None:
        return ""
    if isinstance(value, list):
        return "".join(p.get("text") or "" if isinstance(p, dict) else str(p) for p in value)
    return str(value)


def row_to_messages(row: dict[str, Any], format: str) -> list[dict[str, str]]:
    """One row of a chat format -> ``[{"role", "content"}]``, trailing non-assistant turns cut.

    Raises ``SkipRow("empty" | "no_assistant" | "unknown_role")``.
    """
    if format == "openai":
        raw = row.get("messages") or []
        messages = [{"role": str(m.get("role")), "content": _content(m.get("content"))}
                    for m in raw]
    elif format == "sharegpt":
        raw = row.get("conversations") or []
        messages = []
        for m in raw:
            role = ROLES.get(str(m.get("from")).lower())
            if role is None:
                raise SkipRow("unknown_role")
            messages.append({"role": role, "content": _content(m.get("value"))})
    elif format == "prompt_completion":
        prompt, completion = row.get("prompt"), row.get("completion")
        # TRL's conversational prompt/completion rows hold message lists instead of strings
        messages = (list(prompt) if isinstance(prompt, list)
                    else [{"role": "user", "content": _content(prompt)}])
        messages += (list(completion) if isinstance(completion, list)
                     else [{"role": "assistant", "content": _content(completion)}])
        messages = [{"role": m["role"], "content": _content(m["content"])} for m in messages]
    else:
        raise config_error("format", format, f"one of {sorted(set(FORMATS) - {'text'})}",
                           "row_to_messages")
    if not any(m["content"].strip() for m in messages):
        raise SkipRow("empty")
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    if last < 0:
        raise SkipRow("no_assistant")
    return messages[: last + 1]


def truncated_turns(row: dict[str, Any]) -> frozenset[int]:
    """Message indices (``row_to_messages`` numbering) of answers cut by ``max_tokens``."""
    return frozenset(int(i) for i in row.get(TRUNCATED_COLUMN) or ())


# --------------------------------------------------------------------------------- masks

def render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False,
           **template_kwargs: Any) -> str:
    """The chat template's text; ``template_kwargs`` (``enable_thinking``) reach the template
    as variables, as vLLM's ``chat_template_kwargs`` do."""
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _turn_span(full: str, before: str, after: str, content: str) -> tuple[int, int] | None:
    """Character span of one answer (+ terminator) in ``full``; None if it cannot be located."""
    if after.startswith(before) and full.startswith(after):
        return len(before), len(after)
    # prefix property broken (see module doc): anchor on the answer's content
    base = _common_prefix_len(full, before)  # the answer starts at or after this
    c = content.strip()
    if not c:
        return None
    at_full, at_after = full.find(c, base), after.rfind(c)
    if at_full < 0 or at_after < 0:
        return None
    lead = after[_common_prefix_len(after, before):at_after]  # template text before the content
    start = at_full
    if lead and at_full - len(lead) >= base and full[at_full - len(lead):at_full] == lead:
        start = at_full - len(lead)
    end = at_full + len(c)
    end += _common_prefix_len(after[at_after + len(c):], full[end:])  # the terminator
    return start, end


def _answer_span(text: str, start: int, end: int) -> tuple[int, int]:
    """``[start, end)`` without the template's whitespace after the terminator."""
    kept = text[start:end].rstrip()
    return (start, start + len(kept)) if kept else (start, end)


def conversation_examples(tokenizer, messages: list[dict[str, str]],
                          truncated: frozenset[int] = frozenset(), **template_kwargs: Any
                          ) -> list[tuple[str, list[tuple[int, int]]]]:
    """The rendered training texts of one conversation, each with the ``[start, end)``
    character spans that are loss targets (see the module doc for when there are several).

    ``truncated``: message indices of answers cut by ``max_tokens``; ``template_kwargs`` go to
    the chat template (``enable_thinking``). Raises ``SkipRow("template_error")`` when the
    template cannot place an answer.
    """
    full = render(tokenizer, messages, **template_kwargs)
    turns = {i: (render(tokenizer, messages[:i], True, **template_kwargs),
                 render(tokenizer, messages[: i + 1], **template_kwargs))
             for i, m in enumerate(messages) if m["role"] == "assistant"}
    whole = all(a.startswith(b) and full.startswith(a) for b, a in turns.values())
    examples, spans = [], []
    for i, (before, after) in turns.items():
        content = messages[i]["content"]
        if i in truncated:
            if content:
                examples.append((before + content, [(len(before), len(before) + len(content))]))
            continue
        span = _turn_span(full if whole else after, before, after, content)
        if span is None:
            raise SkipRow("template_error")
        if whole:
            spans.append(_answer_span(full, *span))
        else:
            examples.append((after, [_answer_span(after, *span)]))
    if spans:
        examples.insert(0, (full, spans))
    return examples


def offsets_to_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for tokens whose character span overlaps one of ``spans`` (sorted, disjoint).

    Zero-width tokens (specials the tokenizer added, offsets ``(0, 0)``) count only strictly
    inside a span.
    """
    mask = [0] * len(offsets)
    j = 0
    for t, (s, e) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= s:  # spans entirely before this token
            j += 1
        if j == len(spans):
            break
        start, end = spans[j]
        if (e > s and s < end and e > start) or (e == s and start < s < end):
            mask[t] = 1
    return mask


def added_special_tokens(tokenizer) -> list[str]:
    """The special tokens the tokenizer adds around a text with ``add_special_tokens=True``."""
    ids = tokenizer("x", add_special_tokens=True)["input_ids"]
    special = set(tokenizer.all_special_ids)
    return tokenizer.convert_ids_to_tokens([i for i in ids if i in special])


def tokenize_messages(tokenizer, messages: list[dict[str, str]], added: list[str] | None = None,
                      truncated: frozenset[int] = frozenset(), **template_kwargs: Any
                      ) -> list[tuple[list[int], list[int]]]:
    """Render + tokenise one conversation -> its examples' ``(input_ids, loss_mask)``, ``[T]``
    each (one example unless the template or ``truncated`` answers need more, see the module
    doc)."""
    added = added_special_tokens(tokenizer) if added is None else added
    out = []
    for text, spans in conversation_examples(tokenizer, messages, truncated, **template_kwargs):
        add_special = bool(added) and not all(tok in text for tok in added)
        enc = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
        out.append((list(enc["input_ids"]), offsets_to_mask(enc["offset_mapping"], spans)))
    return out
