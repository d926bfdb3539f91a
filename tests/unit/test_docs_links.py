"""Every relative link of the Markdown docs, and every docs/ path the code names, resolves.

The docs are README.md, docs/**/*.md (the guides and docs/internals/) and the plugins'
READMEs. A link to a file must name one that exists; a link with an anchor (``page.md#part``
or ``#part``) must name a heading of that page, by the slug GitHub gives it. The code,
scripts and tests point users at ``docs/<page>.md#<anchor>`` in messages and comments; those
must resolve too, so moving a section between the guides and docs/internals/ cannot leave
a dangling pointer behind.

The Markdown is parsed with markdown-it-py (CommonMark), so links inside code spans and
fenced blocks are not links, as on GitHub.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import cache
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

markdown_it = pytest.importorskip("markdown_it")

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md"),
               *(REPO / "plugins").glob("*/README.md")])
CODE_DIRS = ("kvstore_tiers", "scripts", "tests", "plugins", ".ci")
CODE_SUFFIXES = {".py", ".c", ".h", ".sh", ".toml", ".cfg", ".yml", ".yaml", ""}
#: ``docs/page.md`` or ``docs/internals/page.md``, with an optional ``#anchor``.
CODE_REF = re.compile(r"\bdocs/[\w./-]*?\.md(?:#[\w-]+)?")
_MD = markdown_it.MarkdownIt("commonmark")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, punctuation dropped (word characters,
    spaces and hyphens kept), spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def _tokens(path: Path) -> list:
    return _MD.parse(path.read_text())


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a page's headings, a repeated one numbered as GitHub does (-1, -2...)."""
    tokens = _tokens(path)
    seen: Counter[str] = Counter()
    out = set()
    for i, tok in enumerate(tokens):
        if tok.type != "heading_open":
            continue
        text = "".join(c.content for c in tokens[i + 1].children or []
                       if c.type in ("text", "code_inline"))
        base = slug(text)
        out.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return frozenset(out)


def links(path: Path) -> list[str]:
    """The targets of a page's links and images, in order."""
    out = []
    for tok in _tokens(path):
        for child in tok.children or []:
            if child.type == "link_open":
                out.append(str(child.attrs["href"]))
            elif child.type == "image":
                out.append(str(child.attrs["src"]))
    return out


def problem(source: Path, target: str) -> str | None:
    """Why ``target``, written in ``source``, does not resolve; None where it does."""
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:  # http(s), mailto: not this test's business
        return None
    dest = (source.parent / unquote(parts.path)).resolve() if parts.path else source
    if not dest.exists():
        return f"no such file {_shown(dest)}"
    if parts.fragment and dest.suffix == ".md" and parts.fragment not in anchors(dest):
        return f"no heading #{parts.fragment} in {_shown(dest)}"
    return None


def _shown(path: Path) -> Path:
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def _code_files() -> list[Path]:
    out = []
    for top in CODE_DIRS:
        for path in sorted((REPO / top).rglob("*")):
            if (path.is_file() and path.suffix in CODE_SUFFIXES
                    and "__pycache__" not in path.parts and path != Path(__file__)):
                out.append(path)
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_of_a_doc_resolves(doc: Path) -> None:
    bad = [f"{target}: {why}" for target in links(doc) if (why := problem(doc, target))]
    assert not bad, f"{doc.relative_to(REPO)}: " + "; ".join(bad)


def test_every_docs_path_the_code_names_resolves() -> None:
    bad = []
    for path in _code_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for ref in CODE_REF.findall(text):
            why = problem(REPO / "README.md", ref)  # a path from the repository's root
            if why:
                bad.append(f"{path.relative_to(REPO)}: {ref}: {why}")
    assert not bad, "\n".join(bad)


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """A missing file and a missing heading are problems; a heading's GitHub slug is not."""
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## `\"fs\"` means ours; `vllm_fs`\n\n## Again\n\n## Again\n")
    assert anchors(page) == {"title", "fs-means-ours-vllm_fs", "again", "again-1"}
    assert problem(page, "page.md#again-1") is None
    assert problem(page, "#title") is None
    assert problem(page, "https://example.com/x.md#nowhere") is None
    assert "no heading" in (problem(page, "#nowhere") or "")
    assert "no such file" in (problem(page, "other.md") or "")
    body = "[a](page.md#again) `[b](gone.md)`\n\n```\n[c](gone.md)\n```\n![d](img.png)\n"
    (tmp_path / "links.md").write_text(body)
    assert links(tmp_path / "links.md") == ["page.md#again", "img.png"]
