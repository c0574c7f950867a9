"""The OpenAI-compatible HTTP server over the engine (``python infer.py mode=serve``)."""
