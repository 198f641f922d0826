"""``python -m examples.quickstart``: the same as ``python examples/quickstart/app.py``."""

from .app import send_twice

send_twice()
