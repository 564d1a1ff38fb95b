"""Sentence splitting that works beyond English (pure Python, no Spark).

Boundaries: `.`, `!`, `?`, `…` (and Arabic `؟`, Devanagari `।`) followed by white space and a
character that does not continue the sentence (not lower case: `e.g. the`, `10 a.m. on`, `z. B.
das` stay whole); full-width CJK terminators `。！？` with or without a following space; and line
breaks (paragraphs, list items). Trailing closing quotes/brackets stay with their sentence. A few
title abbreviations (`Dr.`, `Mr.`, `Prof.` ...) and single letters (initials, `z. B.`) never end a sentence.
"""

from __future__ import annotations

import re

_CLOSERS = "\"'”’»)]）」』】"
# A candidate end: terminator(s), optional closers, then either white space or (CJK) anything.
_LATIN_END = re.compile(rf"[.!?…؟।]+[{re.escape(_CLOSERS)}]*(?=\s)")
_CJK_END = re.compile(rf"[。！？]+[{re.escape(_CLOSERS)}]*")
_NEWLINES = re.compile(r"\s*\n\s*")
_ABBREV = re.compile(
    r"(?:\b(?:Dr|Mr|Mrs|Ms|Prof|Sr|Jr|St|Mt|No|Nr|vs|ca|bzw|Hr|Fr|Mme|Mlle|Sra|Sr|Dña)\.|(?:^|\s)[A-Za-z]\.)$"
)


def split_sentences(text: str | None) -> list[str]:
    """Split `text` into sentences; empty pieces are dropped, order is kept."""
    if not text:
        return []
    out: list[str] = []
    for para in _NEWLINES.split(text):
        out.extend(_split_paragraph(para))
    return out


def _split_paragraph(text: str) -> list[str]:
    cuts: set[int] = set()
    for m in _CJK_END.finditer(text):
        cuts.add(m.end())
    for m in _LATIN_END.finditer(text):
        end = m.end()
        nxt = text[end:].lstrip()[:1]
        if not nxt or nxt.islower() or nxt in ",;:":
            continue
        if m.group(0).startswith(".") and _ABBREV.search(text[: m.start() + 1]):
            continue
        cuts.add(end)
    pieces, start = [], 0
    for c in sorted(cuts):
        pieces.append(text[start:c])
        start = c
    pieces.append(text[start:])
    return [p.strip() for p in pieces if p.strip()]
