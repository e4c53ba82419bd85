"""Every `megagate ...` command in README.md and docs/*.md names a real command and only real flags, and the cheap
ones (pure planning, dry-runs, listings) run as pasted from the repository root and exit 0.

Commands are read from the fenced shell blocks (continuation lines joined, `# comments` dropped, a `$ ` prompt
stripped; `torchrun ... -m megagate` and `srun python -m megagate` count) and from inline code spans that start with
`megagate `. Placeholders are allowed (`cfg.yaml`, `RUNS...`, `[--format A|B]`): a flag inside brackets is still
checked, a value is not.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from helpers.doc_blocks import shell_blocks
from megagate import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INLINE = re.compile(r"`(megagate [^`]+)`")
LAUNCHER = re.compile(r"^(?:\$ )?(?:.*\s)?(?:-m |(?<![\w/.-]))megagate(?=\s)")


def shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command) of each fenced block line that runs megagate."""
    return [(n, c) for block in shell_blocks(text) for n, c in block if LAUNCHER.search(c)]


def commands() -> list[tuple[str, str]]:
    """(where, the megagate argv as text) of every command in the docs."""
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for number, line in shell_lines(text):
            match = LAUNCHER.search(line)
            rest = line[match.end() :].strip()
            found.append((f"{path.relative_to(ROOT)}:{number}", rest.split("&&")[0].split("|")[0].split(";")[0]))
        for number, line in enumerate(text.splitlines(), 1):
            for span in INLINE.findall(line):
                found.append((f"{path.relative_to(ROOT)}:{number}", span[len("megagate ") :]))
    return found


COMMANDS = commands()


def _tokens(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:  # an unbalanced quote in a placeholder
        return text.split()


def _options(parser) -> tuple[set[str], dict[str, object]]:
    """(option strings, sub-command name -> sub-parser) of an argparse parser."""
    options, subs = set(), {}
    for action in parser._actions:
        options.update(action.option_strings)
        if action.__class__.__name__ == "_SubParsersAction":
            subs.update(action.choices)
    return options, subs


def check(argv_text: str) -> str | None:
    """Why the command is not a real megagate command line, or None."""
    tokens = _tokens(argv_text)
    while tokens and tokens[0] == "--verbose":
        tokens = tokens[1:]
    if not tokens or tokens[0] in ("COMMAND", "...", "--help"):
        return None
    name = tokens[0]
    if name.endswith(":"):  # megagate's own output quoted in the text ("megagate train: error: ..."), not a command
        return None
    if name not in cli.COMMANDS:
        return f"{name!r} is not a command"
    parser = cli.OneLineParser(prog=f"megagate {name}")
    cli.command_module(name).add_arguments(parser)
    options, subs = _options(parser)
    rest = tokens[1:]
    if subs:
        words = [t for t in rest if not t.startswith("-")]
        if words and words[0] in subs:
            sub_options, _ = _options(subs[words[0]])
            options |= sub_options
        elif words and not words[0].isupper() and words[0] not in ("...", "[...]"):
            return f"{name} {words[0]!r} is not a sub-command ({', '.join(subs)})"
    for token in rest:
        for flag in re.findall(r"(?:^|[\[|(])(--?[A-Za-z][\w-]*)", token):
            if flag not in options and flag != "-h":
                return f"{name}: {flag} is not a flag of the command"
    return None


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_doc_command_is_real(where: str, argv: str) -> None:
    assert check(argv) is None, f"{where}: megagate {argv}: {check(argv)}"


def test_the_docs_have_commands() -> None:
    assert len(COMMANDS) > 100, len(COMMANDS)
    assert not [w for w, a in COMMANDS if a.startswith("-m ")]  # the launcher pattern took the module form


# pure arithmetic, listings and dry-runs: nothing trained, nothing written
CHEAP = re.compile(r"^(variants\b|plan \S+\.yaml|train --config \S+ .*--dry-run|submit \S+\.yaml .*--dry-run)")


def cheap() -> list[tuple[str, str]]:
    """The cheap commands, each once (the first place it appears): `variants --build` (every variant of three
    models built) is left to tests/test_parameter_counts.py."""
    picked: dict[str, str] = {}
    for where, argv in COMMANDS:
        tokens = _tokens(argv)
        if not CHEAP.match(argv) or any(t.startswith("[") or t.isupper() or "..." in t for t in tokens):
            continue
        if any(t.endswith(".yaml") and not (ROOT / t).exists() for t in tokens) or "--profile" in tokens:
            continue  # a placeholder config
        if any("runs/" in t for t in tokens):
            continue  # reads what an earlier command of its page wrote
        if "--build" not in tokens:
            picked.setdefault(" ".join(tokens), where)
    return [(where, argv) for argv, where in picked.items()]


CHEAP_COMMANDS = cheap()
# commands the docs show being refused: (a piece of the command, a piece of its one-line error)
REFUSED = {
    "monitor.spike.treshold=3": "did you mean 'threshold'?",
    "--variants g1-biased-sigmoid": "invalid choice: 'g1-biased-sigmoid'",  # the page's example of a new variant
}


@pytest.mark.parametrize(("where", "argv"), CHEAP_COMMANDS, ids=[w for w, _ in CHEAP_COMMANDS])
def test_cheap_doc_commands_run_as_pasted(where: str, argv: str, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    before = {p.name for p in ROOT.iterdir()}
    rc = cli.main(_tokens(argv))
    err = capsys.readouterr().err
    refusal = next((message for piece, message in REFUSED.items() if piece in argv), None)
    if refusal is not None:
        assert rc == 2 and refusal in err and err.count("\n") == 1, f"{where}: megagate {argv}: {err}"
        return
    assert rc == 0, f"{where}: megagate {argv}: {err}"
    assert {p.name for p in ROOT.iterdir()} == before  # nothing written at the root


def test_some_cheap_commands_are_run() -> None:
    assert len(CHEAP_COMMANDS) >= 5, CHEAP_COMMANDS
