"""docs/LIBRARIES.md: every reproduction runs and shows what it says.

Each difference that ``python -m conformance peers`` finds in a library's
layer has a section there with a short ``python`` block a user can paste.
Its first line names the versions it was written for
(``# transformers 5.25.0, torch 2.13.0``) and it checks itself with
``assert``. Here every block is run as it stands, in a fresh namespace,
when those exact versions are installed (else it is skipped with the
reason: another version may behave otherwise, which is the point of naming
it); a block that no longer reproduces fails.
"""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "LIBRARIES.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
HEADING = re.compile(r"^### (.+)$", re.M)
VERSION = re.compile(r"([A-Za-z][\w.-]*) (\d+(?:\.\d+)+)")
#: a reproduction a user can paste: about ten lines, the version comment included
MAX_LINES = 14


def _blocks():
    text = DOC.read_text() if DOC.exists() else ""
    out, seen = [], {}
    for match in BLOCK.finditer(text):
        headings = HEADING.findall(text, 0, match.start())
        title = headings[-1].strip("` ") if headings else "top"
        seen[title] = seen.get(title, 0) + 1
        out.append(pytest.param(match.group(1), id=f"{title}-{seen[title]}"))
    return out


BLOCKS = _blocks()


def test_the_page_has_reproductions():
    assert DOC.exists(), "docs/LIBRARIES.md is missing"
    assert len(BLOCKS) >= 5, f"{len(BLOCKS)} reproductions in docs/LIBRARIES.md"


@pytest.mark.parametrize("code", BLOCKS)
def test_a_reproduction_is_short_and_names_its_versions(code):
    lines = code.rstrip("\n").splitlines()
    assert len(lines) <= MAX_LINES, f"{len(lines)} lines: a reproduction has at most {MAX_LINES}"
    assert lines[0].startswith("#") and VERSION.findall(lines[0]), (
        f"the first line names the versions it was written for, got {lines[0]!r}")
    assert "assert" in code, "a reproduction checks what it claims with assert"
    assert "from_pretrained" not in code and "http" not in code, "nothing is downloaded"


@pytest.mark.parametrize("code", BLOCKS)
def test_a_reproduction_still_reproduces(code):
    for name, version in VERSION.findall(code.splitlines()[0]):
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{name} is not installed")
        if installed.split("+")[0] != version:
            pytest.skip(f"written for {name} {version}, {installed} is installed")
    exec(compile(code, "<LIBRARIES.md>", "exec"), {"__name__": "__libraries_md__"})
