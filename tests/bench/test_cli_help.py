"""Every option and positional of every ``dobb-bench`` subcommand has help text (issue 53, item 11).

The walk reads the parsers ``dobb_bench.cli.build_parser`` builds, every nested sub-parser
included, so a command added later is covered without naming it here.
"""
from __future__ import annotations

import argparse

from dobb_bench.cli import _COMMAND_MODULES, build_parser


def _walk(parser: argparse.ArgumentParser, path: str):
    """(command path, action) of every argument of ``parser`` and of its sub-parsers."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def _commands(parser) -> list[str]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(subs[0].choices) if subs else []


def test_every_option_of_every_subcommand_has_help():
    parser = build_parser()
    missing = [f"{path}: {'/'.join(a.option_strings) or a.dest}" for path, a in _walk(parser, "dobb-bench")
               if not (a.help and a.help.strip()) or a.help == argparse.SUPPRESS]
    assert not missing, "options without help text:\n" + "\n".join(missing)


def test_the_walk_sees_every_subcommand_and_their_options():
    """The walk is not vacuous: it reaches each registered module's subcommands and their options."""
    parser = build_parser()
    commands = _commands(parser)
    assert {"train", "compare", "sweep", "project", "timing", "looptime", "study"} <= set(commands)
    assert len(commands) >= len(_COMMAND_MODULES)
    seen = {path.split()[1] for path, _ in _walk(parser, "dobb-bench")}
    assert seen == set(commands), set(commands) - seen
    compare = {o for path, a in _walk(parser, "dobb-bench") if path == "dobb-bench compare" for o in a.option_strings}
    assert {"--optimizers", "--steps", "--seed", "--weight-decay", "--device", "--dry-run"} <= compare


def test_an_option_without_help_is_caught():
    """The check itself fails on a parser with a bare option (a bare positional too)."""
    p = argparse.ArgumentParser(prog="x")
    sub = p.add_subparsers()
    q = sub.add_parser("cmd", help="a command")
    q.add_argument("--bare")
    q.add_argument("thing")
    q.add_argument("--fine", help="has help")
    bare = [a.dest for _, a in _walk(p, "x") if not a.help]
    assert bare == ["bare", "thing"]
