"""The documentation holds together: every relative link and anchor resolves, every ``docs/….md``
the code, scripts and configs name exists, every page is in the index (docs/README.md), and the
reference pages say what is, not how it came to be (no issue numbers, no seed numbers)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.paths import REPO

DOCS = REPO / "docs"
PAGES = sorted([REPO / "README.md", REPO / "loadtest" / "README.md", REPO / "spark" / "README.md",
                *DOCS.rglob("*.md")])
#: the pages that describe what Lodestone does (docs/README.md, "Reference"): no history there
REFERENCE = ["configuration.md", "router.md", "broker.md", "cluster.md", "ha.md", "broker-connections.md",
             "site-failover.md", "security.md", "clients.md", "gravity.md"]
HISTORY = re.compile(r"\b[Ii]ssues? #?\d+\b|\bseeds? 00\d\b|\bthis session\b")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and spaces dropped,
    spaces to hyphens."""
    text = re.sub(r"`|\*|_(?=\w)|(?<=\w)_", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for link in _links(page):
        if re.match(r"[a-z]+:", link):   # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {target.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_every_docs_page_the_code_names_exists():
    named: dict[str, set[str]] = {}
    for ext in ("py", "sh", "toml", "js", "md"):
        for f in REPO.rglob(f"*.{ext}"):
            if any(part in (".venv", "node_modules", ".git", "var") for part in f.relative_to(REPO).parts):
                continue
            for m in re.finditer(r"\bdocs/[A-Za-z0-9_/-]+\.md\b", f.read_text(errors="replace")):
                named.setdefault(m.group(0), set()).add(str(f.relative_to(REPO)))
    missing = {doc: sorted(where)[:3] for doc, where in named.items() if not (REPO / doc).exists()}
    assert not missing, missing


def test_every_page_is_in_the_index():
    index = (DOCS / "README.md").read_text()
    linked = {(DOCS / link.partition("#")[0]).resolve() for link in _links(DOCS / "README.md")
              if not re.match(r"[a-z]+:", link)}
    pages = {p.resolve() for p in DOCS.rglob("*.md") if p.name != "README.md"}
    assert not pages - linked, f"not in docs/README.md: {sorted(str(p.relative_to(REPO)) for p in pages - linked)}"
    assert "## Reference" in index and "## Guides" in index and "## Design notes" in index


@pytest.mark.parametrize("name", REFERENCE)
def test_reference_pages_carry_no_history(name):
    lines = [f"{i}: {line.strip()[:100]}" for i, line in enumerate((DOCS / name).read_text().splitlines(), 1)
             if HISTORY.search(line)]
    assert not lines, f"docs/{name} (reference) tells history; move it to docs/design/: " + " | ".join(lines)
