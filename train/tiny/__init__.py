"""The embedded default: the tiny target, its draft LM, their corpus and held-out prompts."""
