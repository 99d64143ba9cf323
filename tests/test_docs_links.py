"""The documentation stays inside the repository and agrees with it.

Every relative link in README.md and docs/*.md reaches a file of the
repository (and a heading, when it names one); nothing refers to the
internal brief outside the repository; docs/SPEC.md carries numpy_ref's
spec version, and every test and conformance case it cites exists.
"""
import fnmatch
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

import numpy_ref

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SPEC = ROOT / "docs" / "SPEC.md"

# Written in two pieces so that this file does not match itself.
OUTSIDE_REFERENCES = ("../" "shared", "shared/" "SPEC")
SCANNED_SUFFIXES = {".md", ".py", ".toml"}
SKIPPED_DIRS = {"__pycache__", "build", "dist", "node_modules"}

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # https:, mailto:, ...
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def _prose(path: Path) -> str:
    """The Markdown of ``path`` without fenced code blocks (a link there is code)."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def _links(path: Path):
    text = _prose(path)
    return INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)


def _relative_links():
    """``(doc, target)`` for every link that is not a URL, with a readable id."""
    pairs = [(doc, t) for doc in DOCS for t in _links(doc) if t and not EXTERNAL.match(t)]
    return pytest.mark.parametrize(
        "doc, target", pairs, ids=[f"{d.relative_to(ROOT)}->{t}" for d, t in pairs]
    )


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def _anchors(path: Path) -> set:
    seen, anchors = {}, set()
    for heading in HEADING.findall(_prose(path)):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _resolve(doc: Path, target: str) -> tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return (doc if not path else (doc.parent / unquote(path)).resolve()), anchor


def _repository_texts():
    for path in sorted(ROOT.rglob("*")):
        parts = path.relative_to(ROOT).parts
        if any(p.startswith(".") or p in SKIPPED_DIRS or p.endswith(".egg-info") for p in parts):
            continue
        if path.suffix in SCANNED_SUFFIXES and path.is_file():
            yield path


def _spec_code_spans():
    return CODE_SPAN.findall(_prose(SPEC))


# --------------------------------------------------------------------------
# links


def test_the_docs_have_links_to_check():
    assert SPEC in DOCS
    assert any(_links(doc) for doc in DOCS)


@_relative_links()
def test_a_relative_link_stays_inside_the_repository(doc, target):
    path, _ = _resolve(doc, target)
    assert not target.startswith("/"), f"{doc.name}: {target} is absolute; link relative to the page"
    assert path == ROOT or ROOT in path.parents, f"{doc.name}: {target} leaves the repository"


@_relative_links()
def test_a_relative_link_names_an_existing_file_and_heading(doc, target):
    path, anchor = _resolve(doc, target)
    assert path.exists(), f"{doc.name}: {target} does not exist"
    if anchor:
        assert path.suffix == ".md", f"{doc.name}: {target} has an anchor into a non-Markdown file"
        assert anchor in _anchors(path), f"{doc.name}: no heading for #{anchor} in {path.name}"


def test_slug_follows_github_for_code_punctuation_and_numbers():
    assert _slug("3.4 A fully masked query row is zero") == "34-a-fully-masked-query-row-is-zero"
    assert _slug("Package `__init__`") == "package-__init__"
    assert _slug("Differences from `jax.nn.dot_product_attention`") == (
        "differences-from-jaxnndot_product_attention")


def test_nothing_in_the_repository_refers_to_the_brief_outside_it():
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _repository_texts()
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if any(needle in line for needle in OUTSIDE_REFERENCES)
    ]
    assert not hits, "\n".join(hits)


def test_the_scan_reads_the_spec_the_sources_and_the_project_file():
    scanned = {p.relative_to(ROOT).as_posix() for p in _repository_texts()}
    assert {"docs/SPEC.md", "numpy_ref/__init__.py", "pyproject.toml", "README.md"} <= scanned


# --------------------------------------------------------------------------
# docs/SPEC.md against the code


def test_the_spec_version_line_matches_numpy_ref():
    match = re.search(r"^Spec version: \*\*([^*]+)\*\*", SPEC.read_text(encoding="utf-8"), re.M)
    assert match, "docs/SPEC.md needs a line 'Spec version: **X.Y**'"
    assert match.group(1) == numpy_ref.SPEC_VERSION


def test_every_test_the_spec_cites_exists():
    defined = {
        name
        for path in (ROOT / "tests").rglob("test_*.py")
        for name in re.findall(r"^\s*def (test_\w+)\(", path.read_text(encoding="utf-8"), re.M)
    }
    cited, missing = 0, []
    for span in _spec_code_spans():
        file, _, name = span.rpartition("::")
        if file.startswith("tests/") and not list(ROOT.glob(file)):
            missing.append(span)
        if name.startswith("test_") or (not file and span.startswith("test_") and "." not in span):
            name = name or span
            cited += 1
            if not fnmatch.filter(defined, name):
                missing.append(span)
        elif span.startswith("tests/") and not list(ROOT.glob(span)):
            missing.append(span)
    assert cited >= 20, cited
    assert not missing, missing


def test_every_conformance_case_the_spec_cites_exists():
    from conformance.catalog import CASES

    names = [c.name for c in CASES]
    components = {n.split("/")[0] for n in names}
    cited = [s for s in _spec_code_spans()
             if re.fullmatch(r"[\w*+.-]+(/[\w*+.-]+)+", s) and s.split("/")[0] in components | {"*"}
             and not s.endswith(".py")]
    assert len(cited) >= 30, cited
    missing = [s for s in cited if not fnmatch.filter(names, s)]
    assert not missing, missing
