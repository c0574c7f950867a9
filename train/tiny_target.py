"""The embedded default target: a tiny Llama code model trained on the Python standard library.

No model can be downloaded on a CI machine or an air-gapped laptop, yet every acceptance number
needs a target with real structure. The standard library's own ``.py`` files exist wherever Python
does, so draftsmith trains its default target (and a smaller draft LM with the same tokenizer) on
them, split by file into train and held-out sets, and saves normal Hugging Face model directories.

This module holds the pieces other modules rely on (the chat template, the tokenizer, the corpus
split); the builder itself lives below them.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|end|>"  # ends an assistant turn; what generation stops on
DOC_TOKEN = "<|endoftext|>"  # separates raw documents; also the pad token
SPECIAL_TOKENS = [DOC_TOKEN, EOS_TOKEN, "<|system|>", "<|user|>", "<|assistant|>"]

# One role header per turn, every turn closed by <|end|>. The generation prompt opens an
# assistant turn. Used for prompt/completion pairs built from code: the user turn is a code
# prefix, the assistant turn its continuation.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus(seed: int = 0, heldout_fraction: float = 0.1,
                  root: Path | None = None) -> tuple[list[str], list[str]]:
    """Split the standard library's ``.py`` files (relative paths, sorted) into train / held-out.

    Tests and site-packages are skipped: tests are repetitive and site-packages differs per
    machine. The split is by file, so held-out code was never seen in training.
    """
    root = root or stdlib_root()
    skip = ("site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__")
    files = sorted(
        str(p.relative_to(root)) for p in root.rglob("*.py")
        if not any(part in skip for part in p.relative_to(root).parts)
    )
    if not files:
        raise FileNotFoundError(f"no .py files found under the standard library at {root}")
    rng = random.Random(seed)
    shuffled = files[:]
    rng.shuffle(shuffled)
    n_held = max(1, int(len(files) * heldout_fraction))
    return sorted(shuffled[n_held:]), sorted(shuffled[:n_held])


def train_tokenizer(texts: list[str], vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """Byte-level BPE over ``texts`` with draftsmith's special tokens and chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=DOC_TOKEN, unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
