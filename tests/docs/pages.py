"""Reading the documentation pages: fenced blocks and the markers that tag them for tests."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# A fence and its body; an optional HTML comment right before it tags the block.
_BLOCK = re.compile(
    r"(?:<!--\s*(?P<tag>[\w-]+)(?::\s*(?P<value>[^>]*?))?\s*-->\n)?^```(?P<lang>\w*)\n(?P<body>.*?)^```\s*$",
    re.S | re.M,
)


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: Path
    lang: str
    body: str
    tag: str | None
    value: str | None
    line: int

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, in order, with the tag of the comment before it."""
    text = page.read_text()
    return [
        Block(
            page,
            m["lang"],
            m["body"],
            m["tag"],
            (m["value"] or "").strip() or None,
            text.count("\n", 0, m.start("body")),
        )
        for m in _BLOCK.finditer(text)
    ]


def pages() -> list[Path]:
    """Every Markdown page of the site, and the README (the front page)."""
    return [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
