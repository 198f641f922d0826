"""``python -m fenced``: the same as the ``fenced`` command."""

from .cli import main

main()
