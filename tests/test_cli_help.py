"""Every command explains itself: each subcommand of ``aurora`` and each experiment's command
has a description, every option a help, and no help shows reST markup."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aurora import cli

ROOT = Path(__file__).resolve().parent.parent
MARKUP = re.compile(r"``|:(func|mod|class|meth|attr|data):`")
EXPERIMENTS = sorted(
    p.stem
    for p in (ROOT / "experiments").glob("*.py")
    if "def main(" in p.read_text() and p.stem != "__init__"
)


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """``(path, parser)`` for ``parser`` and every subcommand under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, (*path, name))


def problems(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[str]:
    """What a user would miss in ``parser``'s help: a description, an option's help, a
    subcommand's line in its parent's list; markup anywhere."""
    where = " ".join(path) or "(top)"
    found = []
    if not (parser.description or "").strip():
        found.append(f"{where}: no description")
    elif MARKUP.search(parser.description):
        found.append(f"{where}: markup in the description: {parser.description!r}")
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            listed = {c.dest for c in action._choices_actions if (c.help or "").strip()}
            for name in action.choices:
                if name not in listed:
                    found.append(f"{where} {name}: no help line in the list of subcommands")
            continue
        name = "/".join(action.option_strings) or action.dest
        text = action.help
        if text is None or text == argparse.SUPPRESS or not text.strip():
            found.append(f"{where} {name}: no help")
        elif MARKUP.search(text):
            found.append(f"{where} {name}: markup in the help: {text!r}")
    return found


def test_every_subcommand_has_a_description_and_every_option_a_help():
    every = list(walk(cli.build_parser()))
    assert len(every) >= 17  # aurora, sim, real, the roles, keys, delta, ... each counted
    found = [p for path, parser in every for p in problems(parser, path)]
    assert not found, "\n".join(found)


class _Captured(Exception):
    pass


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_command_has_a_description_and_every_option_a_help(name, monkeypatch):
    """Each experiment builds its parser inside ``main``: catch it where it parses."""
    seen: list[argparse.ArgumentParser] = []

    def capture(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(self)
        raise _Captured

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    module = importlib.import_module(f"experiments.{name}")
    with pytest.raises(_Captured):
        module.main([])
    found = [p for path, parser in walk(seen[0], (name,)) for p in problems(parser, path)]
    assert not found, "\n".join(found)


def test_every_subcommand_prints_its_help(capsys):
    """``aurora ... --help`` for every subcommand: exit 0 and the description on stdout."""
    for path, parser in walk(cli.build_parser()):
        with pytest.raises(SystemExit) as stop:
            cli.main([*path, "--help"])
        assert stop.value.code == 0, path
        out = capsys.readouterr().out
        first = " ".join(parser.description.split()[:4])
        assert first in " ".join(out.split()), (path, out[:300])


def test_aurora_help_runs_as_a_command():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "aurora.cli", "--help"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0
    assert "AuroraRL" in done.stdout and "sim" in done.stdout and "real" in done.stdout
    assert "``" not in done.stdout
