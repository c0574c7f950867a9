"""``make gpu-check``'s script, run on the CPU at tiny shapes so it cannot rot between the rare
sessions that have a GPU: every part runs and reports numbers, none fails."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_cpu_at_tiny_shapes():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device",
                           "cpu", "--quick"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout[proc.stdout.index("## GPU check"):]
    assert "no CUDA device: the CPU run at tiny shapes" in out and "FAILED" not in out
    for title in ("CUDA tests", "Decode throughput", "Draft step costs",
                  "Triton rejection sampler", "One EAGLE-3 training step",
                  "Decode throughput of transformers compiled"):
        assert f"### {title}" in out
    decode = re.findall(r"^\| tiny \| (\d+) \| - \| (\d+) \| (\d+) \| (\d+) \|", out, re.M)
    assert [int(b) for b, *_ in decode] == [1, 8]
    assert all(int(v) > 0 for row in decode for v in row[1:])
    assert re.search(r"^\| 1 \| 3 \| 64 \| yes \|", out, re.M)  # Triton == reference
    # the head step (eager / graphs) costs under one target step
    assert re.search(r"^\| 8 \| [\d.]+ / [\d.]+ \| [\d.]+ / [\d.]+ \| 0\.\d\d \|", out, re.M)
    assert re.search(r"ms per step, \d+ tokens/s", out)
