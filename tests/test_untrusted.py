"""Untrusted files (docs/design.md, "Invariants"): nothing unpickles without
``weights_only=True``, no remote code.

A checkpoint, a drafter or a dataset is a file someone else may have made, and a pickle runs
code when loaded. The project's own Python is read (``ast``, not regexes, so strings and comments
do not count) for every way to unpickle or to run a model's code: ``torch.load`` without
``weights_only=True``, ``pickle`` / ``dill`` / ``joblib`` / ``marshal`` / ``shelve`` loads,
``numpy.load(allow_pickle=...)``, unsafe YAML, and ``trust_remote_code`` set to anything but
``False`` or a config value named ``trust_remote_code``. Each rule is first shown to fire on a
snippet, so an empty result means something. The resume path (accelerate's pickles) is tested
behaviourally in tests/train/test_trainer.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
_LOADS = {"load", "loads", "Unpickler", "open"}  # open: shelve
_YAML_UNSAFE = {"load", "unsafe_load", "full_load", "load_all", "unsafe_load_all"}


def project_files() -> list[Path]:
    files = [p for pkg in ("infer", "train", "scripts") for p in (ROOT / pkg).rglob("*.py")]
    return sorted(files + list(ROOT.glob("*.py")))


def _dotted(node: ast.AST) -> str:
    """``torch.load`` for ``Attribute(Name(torch), load)``; "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _call_problem(call: ast.Call) -> str | None:
    name = _dotted(call.func)
    head, _, last = name.rpartition(".")
    if name == "torch.load" and not _is_const(_kw(call, "weights_only"), True):
        return "torch.load without weights_only=True"
    if head.split(".")[0] in _PICKLERS and last in _LOADS:
        return f"{name}: unpickling"
    if name in ("np.load", "numpy.load") and _kw(call, "allow_pickle") is not None \
            and not _is_const(_kw(call, "allow_pickle"), False):
        return f"{name} with allow_pickle"
    if head == "yaml" and last in _YAML_UNSAFE:
        return f"{name}: may build arbitrary objects (use yaml.safe_load)"
    remote = _kw(call, "trust_remote_code")
    if remote is not None and not (_is_const(remote, False) or (
            isinstance(remote, ast.Attribute) and remote.attr == "trust_remote_code")):
        return "trust_remote_code not False and not from a config key of that name"
    return None


def _import_problem(node: ast.Import | ast.ImportFrom) -> str | None:
    if isinstance(node, ast.ImportFrom):
        module = (node.module or "").split(".")[0]
        names = {a.name for a in node.names}
        if module == "torch" and node.module == "torch" and "load" in names:
            return "from torch import load (call torch.load(..., weights_only=True))"
        if module in _PICKLERS and names & _LOADS:
            return f"from {node.module} import {', '.join(sorted(names & _LOADS))}"
        return None
    bad = {a.name.split(".")[0] for a in node.names} & (_PICKLERS - {"pickle", "marshal"})
    return f"import {', '.join(sorted(bad))}: a pickle loader" if bad else None


def problems(source: str, name: str = "<snippet>") -> list[str]:
    """``file:line: what`` for every unsafe load or remote-code switch in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        what = None
        if isinstance(node, ast.Call):
            what = _call_problem(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            what = _import_problem(node)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):  # key None: a **spread
                if isinstance(key, ast.Constant) and key.value == "trust_remote_code" \
                        and not _is_const(value, False):
                    what = "trust_remote_code in a mapping, not False"
        if what:
            found.append(f"{name}:{node.lineno}: {what}")
    return found


@pytest.mark.parametrize("snippet", [
    "import torch\ntorch.load(path)",
    "import torch\ntorch.load(path, weights_only=False)",
    "import torch\ntorch.load(path, map_location='cpu', weights_only=flag)",
    "from torch import load",
    "import pickle\npickle.load(f)",
    "import pickle\npickle.loads(b)",
    "import pickle\npickle.Unpickler(f).load()",
    "from pickle import loads",
    "import dill",
    "import joblib\njoblib.load(p)",
    "import marshal\nmarshal.loads(b)",
    "import shelve\nshelve.open(p)",
    "import numpy as np\nnp.load(p, allow_pickle=True)",
    "import yaml\nyaml.load(text, Loader=yaml.Loader)",
    "AutoTokenizer.from_pretrained(p, trust_remote_code=True)",
    "AutoModel.from_pretrained(p, trust_remote_code=remote)",
    "kwargs = {'trust_remote_code': True}",
])
def test_each_rule_fires(snippet):
    assert problems(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "import torch\ntorch.load(path, map_location='cpu', weights_only=True)",
    "import pickle\nraise pickle.UnpicklingError('x')",
    "import numpy as np\nnp.load(p)\nnp.load(p, allow_pickle=False)",
    "import yaml\nyaml.safe_load(text)",
    "AutoTokenizer.from_pretrained(p)",
    "AutoModel.from_pretrained(p, trust_remote_code=cfg.model.trust_remote_code)",
    "s = 'torch.load(x) pickle.load(f) trust_remote_code=True'  # text, not code",
])
def test_safe_code_passes(snippet):
    assert problems(snippet) == []


def test_the_project_never_unpickles_unsafely_nor_runs_remote_code():
    files = project_files()
    assert {"infer/engine.py", "train/trainer.py", "train.py", "infer.py"} <= {
        p.relative_to(ROOT).as_posix() for p in files}
    found = [msg for p in files
             for msg in problems(p.read_text(encoding="utf-8"), p.relative_to(ROOT).as_posix())]
    assert found == [], "\n".join(found)
