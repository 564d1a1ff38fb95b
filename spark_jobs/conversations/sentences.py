"""Cut context text into units for the relevance scores (pure Python, no Spark, linear time).

`split_units` first finds structured blocks, each kept whole and verbatim (leading whitespace
included): fenced code blocks (``` or ~~~ up to the matching fence), indented code (lines
starting with 4 spaces or a tab), JSON objects/arrays (a line starting with `{` or `[` up to the
balancing bracket, string-aware), Markdown tables (consecutive `|` lines) and list items (a
`-`/`*`/`+`/`•`/`1.`/`1)` line with its indented continuation lines). The prose between them is
cut into sentences by `split_sentences`.

Sentence boundaries: `.`, `!`, `?`, `…` (and Arabic `؟`, Devanagari `।`) followed by white space
and a character that does not continue the sentence (not lower case: `e.g. the`, `10 a.m. on`,
`z. B. das` stay whole); full-width CJK terminators `。！？` with or without a following space;
and line breaks. Trailing closing quotes/brackets stay with their sentence. A few title
abbreviations (`Dr.`, `Mr.`, `Prof.` ...) and single letters (initials, `z. B.`) never end a sentence.

Every step looks at each character a bounded number of times (the abbreviation check reads a
fixed window, not the text before it), so a 1 MB paragraph costs ~16x a 64 KB one.
"""

from __future__ import annotations

import re

_CLOSERS = "\"'”’»)]）」』】"
# A candidate end: terminator(s), optional closers, then either white space or (CJK) anything.
_LATIN_END = re.compile(rf"[.!?…؟।]+[{re.escape(_CLOSERS)}]*(?=\s)")
_CJK_END = re.compile(rf"[。！？]+[{re.escape(_CLOSERS)}]*")
_NEXT = re.compile(r"\s*(\S?)")
_NEWLINES = re.compile(r"\s*\n\s*")
_ABBREV = re.compile(
    r"(?:\b(?:Dr|Mr|Mrs|Ms|Prof|Sr|Jr|St|Mt|No|Nr|vs|ca|bzw|Hr|Fr|Mme|Mlle|Sra|Sr|Dña)\.|(?:^|\s)[A-Za-z]\.)$"
)
_ABBREV_WINDOW = 8  # longest abbreviation ("Mlle.") plus the word boundary before it

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_LIST_ITEM = re.compile(r"^\s*(?:[-*+•]|\d{1,3}[.)])\s+\S")
_INDENTED = re.compile(r"^(?: {4}|\t)\S")
_TABLE = re.compile(r"^\s*\|")


def split_sentences(text: str | None) -> list[str]:
    """Split prose into sentences; empty pieces are dropped, order is kept."""
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
        nxt = _NEXT.match(text, end).group(1)
        if not nxt or nxt.islower() or nxt in ",;:":
            continue
        if m.group(0).startswith(".") and _ABBREV.search(text[max(0, m.start() - _ABBREV_WINDOW): m.start() + 1]):
            continue
        cuts.add(end)
    pieces, start = [], 0
    for c in sorted(cuts):
        pieces.append(text[start:c])
        start = c
    pieces.append(text[start:])
    return [p.strip() for p in pieces if p.strip()]


def _json_end(lines: list[str], i: int) -> int | None:
    """Index after the last line of the JSON value starting at line i, or None when its brackets do
    not balance before a blank line (then it is prose). One pass over the characters."""
    depth, in_str, esc = 0, False, False
    for j in range(i, len(lines)):
        line = lines[j]
        if j > i and not line.strip() and not in_str:
            return None
        for ch in line:
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
        if in_str:  # JSON strings do not span lines
            return None
    return None


def split_units(text: str | None) -> list[str]:
    """Context units of one turn's text, in order: structured blocks whole, prose as sentences."""
    if not text or not text.strip():
        return []
    lines = text.split("\n")
    out: list[str] = []
    prose: list[str] = []

    def flush_prose() -> None:
        if prose:
            out.extend(split_sentences("\n".join(prose)))
            prose.clear()

    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:
            mark = fence.group(1)
            j = i + 1
            while j < n and not lines[j].strip().startswith(mark[0] * len(mark)):
                j += 1
            j = min(j + 1, n)  # the closing fence belongs to the block (an unclosed one runs to the end)
            unit = "\n".join(lines[i:j])
        elif line.lstrip()[:1] in ("{", "[") and (end := _json_end(lines, i)) is not None:
            j, unit = end, "\n".join(lines[i:end])
        elif _TABLE.match(line):
            j = i + 1
            while j < n and _TABLE.match(lines[j]):
                j += 1
            unit = "\n".join(lines[i:j])
        elif _LIST_ITEM.match(line):
            indent = len(line) - len(line.lstrip())
            j = i + 1
            while j < n and lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) > indent:
                j += 1  # continuation lines and nested items stay with their item
            unit = "\n".join(lines[i:j])
        elif _INDENTED.match(line) and not prose:
            j = i + 1
            while j < n and (_INDENTED.match(lines[j]) or (not lines[j].strip() and j + 1 < n
                                                            and _INDENTED.match(lines[j + 1]))):
                j += 1
            unit = "\n".join(lines[i:j])
        else:
            if line.strip():
                prose.append(line)
            else:
                flush_prose()
            i += 1
            continue
        flush_prose()
        out.append(unit.rstrip())
        i = j
    flush_prose()
    return [u for u in out if u.strip()]
