"""The README is a front door and the reference lives in docs/: every relative link resolves, and it stays short."""

import re
import unicodedata
from pathlib import Path

import pytest
from helpers import ROOT

ROOT = Path(ROOT)
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *ROOT.glob("docs/**/*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", page.read_text(), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not ours to check offline
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_readme_is_a_front_door():
    assert len(ROOT.joinpath("README.md").read_text().splitlines()) <= 250
    for page in ("corrections", "engines", "kernels", "rollout-modes", "scale-out", "reliability", "metrics"):
        assert (ROOT / "docs" / f"{page}.md").is_file(), page
