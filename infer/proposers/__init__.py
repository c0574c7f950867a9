"""Proposers, one file per method, registered by name."""
