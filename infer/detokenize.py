"""Output text: decoding, vLLM's stop strings, and the text deltas a stream sends.

One place turns output token ids into text, so ``LLM.generate``'s ``text``, the server's
non-streaming answer and the concatenation of its streamed deltas are the same string.

vLLM's stop-string rules (``SamplingParams.stop``), kept here:

- a request stops at the first token whose text completes one of its stop strings, checked
  only once more than ``min_tokens`` tokens were generated; the tokens up to and including that
  one stay in ``token_ids``, and ``stop_reason`` is the string;
- the text is cut before the stop string (``include_stop_str_in_output`` is not supported);
- a stream holds back the last ``len(longest stop) - 1`` characters until the request ends, so
  it never sends the start of a stop string that the final text drops.

Decoding is ``skip_special_tokens=True``, as in vLLM. A byte-level token can end inside a UTF-8
character (decoded as U+FFFD); a stream holds that character back until the next token
completes it.
"""

from __future__ import annotations

from typing import Any, Sequence

_REPLACEMENT = "\ufffd"


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """Output token ids -> text ("" without a tokenizer: token-id-only models)."""
    if tokenizer is None or not ids:
        return ""
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def cut_at_stop(text: str, stop: str | None) -> str:
    """The text before the first occurrence of the stop string that ended the request."""
    if not stop:
        return text
    at = text.find(stop)
    return text if at < 0 else text[:at]


def output_text(tokenizer: Any, ids: Sequence[int], stop_reason: Any) -> str:
    """A finished request's text: its output decoded, cut before a stop string."""
    text = decode(tokenizer, ids)
    return cut_at_stop(text, stop_reason) if isinstance(stop_reason, str) else text


class StopStrings:
    """Finds the stop string a newly appended token completes.

    Decoding the whole output after every token would cost O(length) per token; only the last
    ``window`` tokens are decoded (each token is at least one byte, so 4 bytes per character of
    the longest stop string plus slack always covers it). A stop string completed by an earlier
    token was already caught then, so one seen in the window now ends here.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.window = 4 * max((len(s) for s in self.stops), default=0) + 4

    def hit(self, output_ids: Sequence[int]) -> str | None:
        """The stop string found in the text of the last ``window`` output tokens, or None."""
        tail = decode(self.tokenizer, output_ids[-self.window:])
        found = [(tail.find(s), s) for s in self.stops if s in tail]
        return min(found)[1] if found else None


class IncrementalText:
    """The text deltas of one streamed request (see the module docstring for what is held
    back). ``delta(ids)`` after each engine step, ``delta(ids, stop_reason, final=True)`` at the
    end; the deltas concatenate to ``output_text(tokenizer, ids, stop_reason)``."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0  # characters sent so far

    def delta(self, ids: Sequence[int], stop_reason: Any = None, final: bool = False) -> str:
        if final:
            text = output_text(self.tokenizer, ids, stop_reason)
        else:
            text = decode(self.tokenizer, ids)
            ready = len(text) - self.hold
            while ready > 0 and text[ready - 1] == _REPLACEMENT:
                ready -= 1  # an unfinished UTF-8 character
            text = text[:max(ready, 0)]
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out
