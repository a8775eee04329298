"""Every command's `--help` ends with an example of that very command: the top level, each
subcommand of `pipeline/cli.py`'s parser and each command it delegates to its own module
(DELEGATED). New commands are found here by walking both, so they are covered as they come."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from pipeline import cli


def _subcommands() -> list[str]:
    """What `specbatch` takes as its first word: cli.py's subparsers and DELEGATED."""
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted({*action.choices, *cli.DELEGATED})


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--help"])
    assert exit_.value.code in (0, None), f"specbatch {' '.join(argv)} --help exited {exit_.value.code}"
    return out.getvalue()


def _last_paragraph(text: str) -> str:
    paragraphs = [p.strip("\n") for p in text.strip().split("\n\n") if p.strip()]
    return paragraphs[-1]


def test_the_walk_finds_every_command():
    names = _subcommands()
    assert {"demo", "run", "tiny-models", "report", "calibrate", "check-drafter", "export"} <= set(names)


@pytest.mark.parametrize("command", [None, *_subcommands()])
def test_help_ends_with_an_example_of_the_command(command):
    argv = [command] if command else []
    last = _last_paragraph(_help(argv))
    assert last.startswith("example"), f"`specbatch {' '.join(argv)} --help` ends with:\n{last}"
    named = f"specbatch {command} " if command else "specbatch "
    assert named in last + " ", f"the example of `specbatch {command}` does not run it:\n{last}"
