"""Runnable scenarios of the seed documents, on an embedded Redis."""
