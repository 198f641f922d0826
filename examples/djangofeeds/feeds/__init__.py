"""Feeds and their entries, imported once at a time per feed and converging on repeats."""
