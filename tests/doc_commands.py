"""The shell commands of the Markdown docs (README.md, docs/**/*.md), as a user reads them.

A command is a line of a fenced ```bash, ```sh, ```shell or ```console block:

* in a bash/sh/shell block, every line that is not a comment;
* in a console block, every line starting with ``$ `` (the lines up to the
  next one are its output).

A trailing backslash, or a quote left open, continues a command on the next
line. A **mark** is a comment line of its own in a block, one of::

    # needs: gpu
    # needs: docker
    # needs: network
    # long-running

and applies to the commands after it in its block, up to the next mark.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
MARKS = ("needs: gpu", "needs: docker", "needs: network", "long-running")
_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_MARK = re.compile(r"^#\s*(needs:\s*\w+|long-running)\s*$")


@dataclass
class Command:
    """One command of a doc, where it is, how it is marked and what output it shows."""

    doc: str  # path relative to the repository
    block: int  # line of the block's opening fence
    line: int  # line of the command's first line
    text: str  # continuation lines joined (a backslash-newline is dropped)
    mark: str | None = None  # one of MARKS, or None
    output: list[str] = field(default_factory=list)  # console: the lines shown after it

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def _complete(text: str) -> bool:
    """Whether ``text`` is a whole command (no trailing backslash, no open quote)."""
    if text.endswith("\\"):
        return False
    try:
        shlex.split(text, comments=True)
    except ValueError:  # "No closing quotation"
        return False
    return True


def _block_commands(doc: str, fence: int, lang: str, body: list[str]) -> list[Command]:
    out: list[Command] = []
    mark: str | None = None
    pending: Command | None = None
    for i, raw in enumerate(body):
        line = raw.rstrip()
        number = fence + 1 + i
        if pending is not None:  # a continuation line
            pending.text = (pending.text[:-1] if pending.text.endswith("\\")
                            else pending.text + "\n") + line.lstrip()
            if _complete(pending.text):
                pending = None
            continue
        stripped = line.strip()
        m = _MARK.match(stripped)
        if m:
            mark = re.sub(r":\s*", ": ", m.group(1))
            if mark not in MARKS:
                raise ValueError(f"{doc}:{number}: unknown mark {stripped!r} (one of {MARKS})")
            continue
        if lang == "console":
            if not stripped.startswith("$ "):
                if out and stripped:
                    out[-1].output.append(stripped)
                continue
            stripped = stripped[2:]
        elif not stripped or stripped.startswith("#"):
            continue
        cmd = Command(doc, fence, number, stripped, mark)
        out.append(cmd)
        if not _complete(cmd.text):
            pending = cmd
    if pending is not None:
        raise ValueError(f"{pending.where}: the command does not end in its block")
    return out


def commands(path: Path) -> list[Command]:
    """Every command of the shell blocks of ``path``, in order."""
    doc = str(path.relative_to(REPO))
    lines = path.read_text().splitlines()
    out: list[Command] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"),
                   len(lines))
        if m.group(2) in SHELL_LANGS:
            indent = len(m.group(1))
            body = [ln[indent:] if ln[:indent].isspace() else ln for ln in lines[i + 1:end]]
            out += _block_commands(doc, i + 1, m.group(2), body)
        i = end + 1
    return out


def all_commands() -> list[Command]:
    return [c for doc in DOCS for c in commands(doc)]
