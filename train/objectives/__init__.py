"""Training objectives, one file per drafter method."""
