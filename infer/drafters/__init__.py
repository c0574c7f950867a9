"""Learned drafter modules and their config.json formats."""
