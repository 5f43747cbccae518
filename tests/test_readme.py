"""The README's module map names every module of the house, and nothing that is gone."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schemas", "stages", "engine", "kernels", "tools")
SOURCE = re.compile(r"\.(py|c|sql)$")


def modules() -> set[str]:
    listed = subprocess.run(
        ["git", "ls-files", *PACKAGES], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    found = {p for p in listed if SOURCE.search(p) and not p.endswith("__init__.py")}
    return {p for p in found if (ROOT / p).exists()}


def module_map() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("### The module map")
    return text[start : text.index("\n## ", start)]


def test_every_module_is_in_the_module_map() -> None:
    table = module_map()
    missing = sorted(m for m in modules() if f"`{m}`" not in table)
    assert not missing, f"README.md's module map lacks {missing}: add a row (or a name to one)"


def test_the_module_map_names_no_module_that_is_gone() -> None:
    pattern = r"`((?:" + "|".join(PACKAGES) + r")/[\w/]+\.(?:py|c|sql))`"
    named = set(re.findall(pattern, module_map()))
    gone = sorted(named - modules())
    assert not gone, f"README.md's module map names {gone}, which no longer exist"
