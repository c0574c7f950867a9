"""``python infer.py mode=serve``: the real entry point in a subprocess, on a free port."""

import json
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from infer.foundation.errors import ConfigError
from infer.serve.server import check_port

ROOT = Path(__file__).resolve().parents[3]


def _read_url(proc: subprocess.Popen, timeout: float = 120.0) -> str | None:
    """The URL from the "serving ... at URL/v1" line, or None if the process ends first."""
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            m = re.search(r"at (http://\S+)/v1 ", line)
            if m:
                found.append(m.group(1))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return found[0] if found else None


def test_infer_py_mode_serve(chat_target):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2})
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "infer.py"), "mode=serve", f"model={chat_target}",
         "serve.port=0", "serve.served_model_name=tiny", f"speculative_config={spec}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = _read_url(proc)
        assert url, proc.stderr.read() if proc.poll() is not None else "no URL printed"
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "def f(",
                                                      "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert "vllm:spec_decode_num_drafts_total" in httpx.get(url + "/metrics").text
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM
        assert "interrupted by SIGTERM; server stopped" in err
    finally:
        proc.kill()
        proc.wait()


def test_port_in_use_is_refused_before_loading():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"serve.port={port}: cannot listen") as err:
            check_port("127.0.0.1", port)
    assert err.value.key == "serve.port"
    check_port("127.0.0.1", 0)  # any free port is fine
