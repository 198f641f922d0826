"""What `make dist` checks in the built sdist and wheel, beyond twine's metadata check.

The wheel holds the package and what it reads at run time (the dashboard's page, the
typing marker, the demo's scenarios), and nothing of the checkout (tests, examples,
benchmarks); its version is the package's one version; each extra is declared. The sdist
holds what builds the wheel again, with the license and the changelog.
"""

from __future__ import annotations

import re
import sys
import tarfile
import zipfile
from pathlib import Path

EXTRAS = {"hiredis", "celery", "cli", "sql", "metrics", "demo", "web", "objstore", "all"}
IN_WHEEL = [
    "fenced/__init__.py",
    "fenced/py.typed",
    "fenced/cli.py",
    "fenced/demo/walkthrough.py",
    "fenced/web/static/",
]
IN_SDIST = ["pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "src/fenced/__init__.py"]
NOT_SHIPPED = re.compile(r"(^|/)(tests|examples|benchmarks|chaos|\.ci)/|__pycache__|\.pyc$")


def version() -> str:
    text = Path("src/fenced/__init__.py").read_text()
    found = re.search(r'^__version__ = "([^"]+)"', text, re.M)
    if not found:
        sys.exit("src/fenced/__init__.py has no __version__ line")
    return found[1]


def main(folder: str) -> int:
    problems: list[str] = []
    want = version()
    wheels = sorted(Path(folder).glob("*.whl"))
    sdists = sorted(Path(folder).glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        sys.exit(f"{folder}: expected one wheel and one sdist, found {wheels + sdists}")
    wheel, sdist = wheels[0], sdists[0]
    if not wheel.name.startswith(f"fenced-{want}-"):
        problems.append(f"{wheel.name}: not version {want} (src/fenced/__init__.py)")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for path in IN_WHEEL:
        if not any(n.startswith(path) for n in names):
            problems.append(f"{wheel.name}: {path} is missing")
    problems += [f"{wheel.name}: ships {n}" for n in names if NOT_SHIPPED.search(n)]
    extras = set(re.findall(r"^Provides-Extra: (\S+)", meta, re.M))
    if extras != EXTRAS:
        problems.append(f"{wheel.name}: extras {sorted(extras)}, expected {sorted(EXTRAS)}")
    if f"Version: {want}\n" not in meta:
        problems.append(f"{wheel.name}: METADATA does not say Version: {want}")
    with tarfile.open(sdist) as t:
        inside = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    problems += [f"{sdist.name}: {p} is missing" for p in IN_SDIST if p not in inside]
    for line in problems:
        print(f"check_dist: {line}", file=sys.stderr)
    if not problems:
        print(f"check_dist: {wheel.name} ({len(names)} files) and {sdist.name}: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "dist"))
