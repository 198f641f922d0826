"""``fenced demo --feeds``: run the feed importer example of a source checkout.

The example is a Django project with its own migrations, sample feeds and Celery app,
so it lives in the repository (``examples/djangofeeds``), not in the installed package;
its ``demo.py`` starts everything it needs. This finds that script in the checkout this
package runs from (an editable install) or in the current directory.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

#: Where the script sits in a checkout, relative to its top directory.
SCRIPT = Path("examples", "djangofeeds", "demo.py")


def find_script(cwd: Path | None = None) -> Path | None:
    """The example's demo.py in this package's checkout or under ``cwd``; None if absent."""
    tops = [Path(__file__).resolve().parents[3], (cwd or Path.cwd()).resolve()]
    return next((top / SCRIPT for top in tops if (top / SCRIPT).is_file()), None)


def main() -> int:
    """Run the example's acts in a child process; its exit status, or 2 without a checkout."""
    script = find_script()
    if script is None:
        print(
            f"fenced demo --feeds runs {SCRIPT.as_posix()} from a checkout of the fenced "
            "source repository; the installed package does not include the example. "
            "Run it from the checkout's top directory (or run that script there directly).",
            file=sys.stderr,
        )
        return 2
    return subprocess.run([sys.executable, str(script)], check=False).returncode
