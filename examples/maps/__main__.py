"""Enqueue rebuilds from the command line: ``python -m maps roads water``."""

from __future__ import annotations

import json
import sys

from .tasks import rebuild_map


def main(argv: list[str]) -> int:
    """Enqueue one rebuild per layer named on the command line and print each result."""
    if not argv:
        print("usage: python -m maps LAYER [LAYER ...]", file=sys.stderr)
        return 2
    results = [rebuild_map.delay(layer) for layer in argv]
    for result in results:
        print(json.dumps(result.get(timeout=600), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
