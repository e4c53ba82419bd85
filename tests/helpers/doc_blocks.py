"""The shell blocks of a Markdown document as commands: what the doc-command tests run or check as pasted."""

from __future__ import annotations

import re

FENCE = re.compile(r"^```(\w*)\s*$")
SHELL = ("", "bash", "sh", "shell", "console")


def strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a `#` inside a word, as in nvcr.io#nvidia, is kept)."""
    return re.split(r"(?:^|\s)#(?=\s|$)", line, maxsplit=1)[0].rstrip()


def shell_blocks(text: str) -> list[list[tuple[int, str]]]:
    """Each shell block's commands as (first line number, command): continuations joined, comments and blank lines
    dropped, in document order."""
    blocks: list[list[tuple[int, str]]] = []
    language, joined, start = None, "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        fence = FENCE.match(raw.strip())
        if fence:
            language = None if language is not None else fence[1]
            if language in SHELL:
                blocks.append([])
            continue
        if language not in SHELL:
            continue
        line = strip_comment(raw)
        if not joined:
            start = number
        if line.endswith("\\"):
            joined += line[:-1] + " "
            continue
        joined += line
        if joined.strip():
            blocks[-1].append((start, joined.strip()))
        joined = ""
    return blocks
