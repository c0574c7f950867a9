"""Start and stop the HTTP server: ``python infer.py mode=serve`` and the tests use the same
:func:`start_server`.

uvicorn runs in a background thread with its own event loop, the engine loop in another; the
caller's thread only waits. That keeps one code path for the blocking entry point (which
waits until Ctrl-C / SIGTERM, turned into ``Interrupted`` by ``infer/foundation/signals.py``, then
shuts
both down in order) and for a test that starts a server on a free port, talks to it, and
closes it.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from infer.engine import LLM
from infer.foundation.errors import ConfigError
from infer.serve.app import build_app
from infer.serve.engine_loop import EngineLoop
from infer.serve.generation import ServedModel
from infer.serve.prometheus import ServeMetrics
from infer.serve.spec_stats import SpecStatsLevel
from infer.foundation.threads import GOVERNOR

_START_TIMEOUT_S = 60.0


@dataclass
class RunningServer:
    """A started server: ``url`` (``http://host:port``), ``served`` (engine, loop, name)."""

    url: str
    served: ServedModel
    _server: uvicorn.Server
    _thread: threading.Thread

    def close(self) -> None:
        """Stop accepting requests, let uvicorn finish, then stop the engine thread."""
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self.served.loop.close()
        GOVERNOR.reserve(0)

    def wait(self) -> None:
        """Block until the server stops (``close`` from elsewhere, or a signal raising here)."""
        while self._thread.is_alive():
            self._thread.join(timeout=0.5)

    def __enter__(self) -> "RunningServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_port(host: str, port: int) -> None:
    """Refuse a host / port that cannot be bound now, before a model is loaded for nothing."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise ConfigError(f"serve.host={host!r}, serve.port={port}: cannot listen there "
                          f"({e.strerror or e}); expected a free port on a local address "
                          "(serve.port=0 picks a free one)", "serve.port") from None


def start_server(llm: LLM, *, host: str = "127.0.0.1", port: int = 8000,
                 model_name: str | None = None, log_level: str = "warning",
                 spec_stats: str = "none") -> RunningServer:
    """Serve ``llm`` on ``host:port`` (0: a free port) and return once it accepts requests;
    ``spec_stats``: per-request speculative-decoding stats (none, summary, detailed)."""
    name = model_name or llm.target.path
    if llm.device.type == "cpu":
        GOVERNOR.reserve(1)  # the event loop's core (infer/foundation/threads.py)
    metrics = ServeMetrics(name, llm.k if llm.spec else None)
    served = ServedModel(llm, EngineLoop(llm, metrics).start(), name, SpecStatsLevel(spec_stats))
    config = uvicorn.Config(build_app(served), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="draftsmith-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            served.loop.close()
            raise RuntimeError(f"the HTTP server did not start on {host}:{port} (port in use? "
                               "see the log above)")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return RunningServer(f"http://{host}:{bound}", served, server, thread)
