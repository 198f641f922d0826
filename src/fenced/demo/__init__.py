"""Runnable scenarios of the map rebuild and feed import examples, on an embedded Redis."""
