"""Every relative link and #anchor in README.md and docs/*.md resolves.

Anchors are GitHub's: a heading's text in lower case, without punctuation but ``-`` and
``_``, spaces as ``-``; a repeated heading gets ``-1``, ``-2``, ...
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code."""
    out, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^#{1,6} (.+)$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text(encoding="utf-8")))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(doc: Path) -> None:
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_links_are_found() -> None:
    readme = links(ROOT / "README.md")
    assert "docs/reference.md" in readme and "#why" in readme
    assert slug("Which Redis: URLs, Sentinel, Cluster, failover") == (
        "which-redis-urls-sentinel-cluster-failover"
    )
    assert slug("`@fenced.exclusive`: the same for Python functions (APScheduler jobs)") == (
        "fencedexclusive-the-same-for-python-functions-apscheduler-jobs"
    )


def test_every_doc_is_linked_from_the_readme() -> None:
    readme = set(links(ROOT / "README.md"))
    missing = [p.name for p in DOCS[1:] if f"docs/{p.name}" not in readme]
    assert not missing, missing
