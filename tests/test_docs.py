"""The README is a front door and the reference lives in docs/: every relative link resolves, it stays short, and
the defaults the pages' field tables state are the schema's."""

import math
import re
import unicodedata
from dataclasses import asdict
from pathlib import Path

import pytest
from helpers import ROOT, compose_config
from omegaconf import OmegaConf

from lit_rl.choices import ALGO_CONFIGS
from lit_rl.schema import DatasetConfig, TrainConfig, VLLMEngineConfig

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


#: the pages whose ``| field | default | ... |`` tables state defaults, checked against the schema's dataclasses
DEFAULT_PAGES = ["configuration.md", "data.md", "engines.md", "environments.md", "rollout-modes.md", "studies.md"]


def default_tables(page: Path) -> list[tuple[list[str], str]]:
    """(the row's fields, its default cell) for each row of the page's ``| field | default | ... |`` tables. A
    field cell lists backticked names; a name without a dot is in the first one's section (`sampling.top_k`)."""
    rows, in_table = [], False
    for line in page.read_text().splitlines():
        if re.match(r"^\| field \| default \|", line):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            names = re.findall(r"`([^`]+)`", cells[0])
            section = names[0].rsplit(".", 1)[0] + "." if "." in names[0] else ""
            rows.append(([n if "." in n else section + n for n in names], cells[1]))
    return rows


def parse_default(text: str):
    """A default as the page writes it: null, true/false, [] (an empty list), a number, else the (un-backticked)
    string."""
    text = text.strip().strip("`")
    if text == "[]":
        return []
    if text in ("null", "true", "false"):
        return {"null": None, "true": True, "false": False}[text]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def same_default(documented, actual) -> bool:
    """Equal as the page means it: numbers by value (0 and 0.0), null and true/false only as themselves."""
    if isinstance(documented, bool) or isinstance(actual, bool) or documented is None or actual is None:
        return documented is actual
    if isinstance(documented, (int, float)) and isinstance(actual, (int, float)):
        return math.isclose(documented, actual, rel_tol=1e-12)
    return documented == actual


def lookup(tree: dict, dotted: str):
    """``tree["a"]["b"]`` for ``"a.b"``."""
    for key in dotted.split("."):
        tree = tree[key]
    return tree


@pytest.mark.parametrize("name", DEFAULT_PAGES)
def test_the_documented_defaults_are_the_schemas(name):
    """Each default a page's field table states is the schema dataclass's (``TrainConfig``; ``task`` fields:
    ``task=dataset``'s, ``engine`` fields: vLLM's, a superset of the embedded engine's with the same defaults).
    A default with per-algorithm exceptions, "1, 1 (PPO 2, 2)", is checked for each algorithm named: an ``algo``
    field against the algorithm's dataclass, another field against the composed ``algo=<name>`` config."""
    schema = asdict(TrainConfig())
    schema["task"], schema["engine"] = asdict(DatasetConfig()), asdict(VLLMEngineConfig())
    rows = default_tables(ROOT / "docs" / name)
    assert rows, f"{name}: no field table"
    wrong = []
    for fields, cell in rows:
        base, _, exceptions = cell.partition(" (")
        if base != "per algorithm":
            values = [parse_default(v) for v in base.split(", ")]
            assert len(values) == len(fields), f"{name}: {fields} lists {len(values)} defaults: {cell!r}"
            wrong += [
                (f, v, lookup(schema, f)) for f, v in zip(fields, values) if not same_default(v, lookup(schema, f))
            ]
        for part in filter(None, exceptions.rstrip(")").split("; ")):
            algo, values = re.match(r"`?(\w+)`?:? (.+)", part).groups()
            algo = algo.lower()
            values = [parse_default(v) for v in values.split(", ")]
            assert algo in ALGO_CONFIGS and len(values) == len(fields), f"{name}: {fields}: {part!r}"
            for field, value in zip(fields, values):
                if field.startswith("algo."):
                    actual = lookup(asdict(ALGO_CONFIGS[algo]()), field.removeprefix("algo."))
                else:
                    actual = OmegaConf.select(compose_config(f"algo={algo}"), field)
                if not same_default(value, actual):
                    wrong.append((f"{field} ({algo})", value, actual))
    assert not wrong, f"{name}: (field, documented, schema): {wrong}"
