"""Every subcommand's --help: each flag explained, each default shown once, no repeated text,
and the command reference (docs/commands.md) lists every flag."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from wavepp import cli

COMMANDS_DOC = Path(__file__).resolve().parents[2] / "docs" / "commands.md"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _commands() -> dict[str, argparse.ArgumentParser]:
    """``{"replay": parser, ..., "bench grid": parser, ...}``: every command that runs."""
    found = {}
    for name in cli.SUBCOMMANDS:
        sub = _subparsers(cli.build_parser([name]))[name]
        nested = _subparsers(sub)
        for child, parser in nested.items():
            found[f"{name} {child}"] = parser
        if not nested:
            found[name] = sub
    return found


COMMANDS = _commands()


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if a.option_strings and a.help is not argparse.SUPPRESS and a.dest != "help"
    ]


def _shown_default(default: object) -> bool:
    """Whether --help must show the default: any but None, False, "" and SUPPRESS (False by
    identity: ``0 in (False,)`` is True, which let a default of 0 go unshown)."""
    return default is not None and default is not False and default not in ("", argparse.SUPPRESS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_each_default_once_and_no_text_twice(command: str) -> None:
    parser = COMMANDS[command]
    formatter = parser._get_formatter()
    helps = []
    for action in _flags(parser):
        flag = action.option_strings[-1]
        assert action.help, f"{command} {flag}: no help text"
        text = formatter._expand_help(action)
        template = formatter._get_help_string(action) or ""
        count = template.lower().count("default") - template.count("%(default)s")
        if _shown_default(action.default) and action.nargs != 0:
            assert count == 1, f"{command} {flag}: default shown {count} times: {text!r}"
        else:
            assert count <= 1, f"{command} {flag}: 'default' {count} times: {text!r}"
        assert "(default: None)" not in text and "(default: )" not in text, (command, text)
        helps.append(action.help)
    repeated = sorted({h for h in helps if helps.count(h) > 1})
    assert not repeated, f"{command}: the same help text twice: {repeated}"
    rendered = parser.format_help()
    assert "(default: None)" not in rendered


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_runs(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([*command.split(), "--help"])
    assert info.value.code == 0
    assert f"wavepp {command}" in capsys.readouterr().out


def _documented_synopses() -> dict[str, str]:
    """The command reference's synopses: each ``wavepp CMD ...`` line of docs/commands.md's
    '## Synopses' section with its indented continuation lines, by command."""
    section = COMMANDS_DOC.read_text().split("\n## Synopses\n", 1)
    assert len(section) == 2, "docs/commands.md has no '## Synopses' section"
    text = section[1].split("\n## ", 1)[0]
    found: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"^wavepp ([a-z-]+(?: [a-z]+)?)(?=\s|$)", line)
        if match and match.group(1) in COMMANDS:
            current = match.group(1)
            found[current] = found.get(current, "") + line + "\n"
        elif current and line.startswith(" "):
            found[current] += line + "\n"
        else:
            current = None
    return found


def test_command_reference_lists_every_flag() -> None:
    synopses = _documented_synopses()
    missing_commands = sorted(set(COMMANDS) - set(synopses))
    assert not missing_commands, f"docs/commands.md synopses lack {missing_commands}"
    for command, parser in COMMANDS.items():
        text = re.sub(r"--\[no-\]([a-z0-9-]+)", r"--\1 --no-\1", synopses[command])
        tokens = set(re.findall(r"--[a-z0-9-]+", text))
        for action in _flags(parser):
            assert any(o in tokens for o in action.option_strings if o.startswith("--")), (
                f"docs/commands.md synopsis of wavepp {command} lacks {action.option_strings[-1]}"
            )
        hidden = {
            o for a in parser._actions if a.help is argparse.SUPPRESS for o in a.option_strings
        }
        stale = sorted(tokens & hidden)
        assert not stale, f"docs/commands.md synopsis of wavepp {command} shows deprecated {stale}"


@pytest.mark.parametrize("argv", [["sim"], ["bench", "grid"]])
def test_bare_command_prints_usage_and_runs_nothing(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: wavepp " + " ".join(argv)) and "nothing was run" in err


def test_command_reference_shows_required_flags_as_required() -> None:
    """The command reference shows a required group as required (``wavepp stage
    (--runtime-config CONFIG | --config CONFIG)``, not both in brackets) as argparse enforces
    it (``one of the arguments ... is required``)."""
    synopses = _documented_synopses()
    for command, parser in COMMANDS.items():
        text = " ".join(synopses[command].split())
        grouped: set[str] = set()
        for group in parser._mutually_exclusive_groups:
            if not group.required:
                continue
            flags = [a.option_strings[-1] for a in group._group_actions]
            grouped.update(flags)
            pattern = r"\(" + r" \| ".join(re.escape(f) + r"(?: [A-Z_]+)?" for f in flags) + r"\)"
            assert re.search(pattern, text), (
                f"docs/commands.md synopsis of wavepp {command}: show ({' | '.join(flags)}), one required"
            )
        for action in _flags(parser):
            flag = action.option_strings[-1]
            if action.required or flag in grouped:
                assert not re.search(r"\[" + re.escape(flag) + r"[ \]]", text), (
                    f"docs/commands.md synopsis of wavepp {command} shows required {flag} as optional"
                )
