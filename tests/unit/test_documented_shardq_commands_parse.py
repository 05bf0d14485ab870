"""Every `shardq` command line the READMEs tell people to type parses: its subcommand
exists, its options exist, the required ones are there and the values have the right
form. The chart's ShardqDeadLetters runbook once said `shardq redrive --queue <dlq>`, an
option redrive never had, for the moment someone is paged about dead letters.

Nothing runs: the command's context is made, as click makes it before invoking it.
Optional parts (`[--rate 500/s]`) are checked too, with the brackets taken off;
placeholders (`<dlq>`) become a word; example paths that do not exist on this machine
(`--file msgs.jsonl`) are the only refusal accepted. A command quoted in prose
(`shardq serve --writer-threads N`) names options rather than a line to type: those
options must exist on that command.
"""

from __future__ import annotations

import pathlib
import re
import shlex

import click
import pytest

from shardq.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
READMES = (ROOT / "README.md", ROOT / "charts" / "shardq" / "README.md")
INLINE = re.compile(r"`(shardq [a-z][^`]*)`")


def fenced_command_lines(text: str) -> list[str]:
    """Lines of fenced code blocks that run shardq, continuations joined, comments cut."""
    commands: list[str] = []
    fenced = False
    pending = ""
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            continue
        if pending:
            pending += " " + line.strip()
        elif line.startswith("shardq "):
            pending = line.strip()
        else:
            continue
        if pending.endswith("\\"):
            pending = pending.removesuffix("\\").strip()
            continue
        commands.append(re.split(r"\s+#", pending, maxsplit=1)[0].strip())
        pending = ""
    return commands


def documented_commands() -> tuple[list[str], list[str]]:
    """The command lines of code blocks, and the commands quoted in prose with options."""
    lines: set[str] = set()
    quoted: set[str] = set()
    for readme in READMES:
        text = readme.read_text()
        lines.update(fenced_command_lines(text))
        # Only those that give options (`shardq serve` alone names a command in prose).
        quoted.update(command for command in INLINE.findall(text) if " --" in command)
    return sorted(lines), sorted(quoted - lines)


def arguments(command: str) -> list[str]:
    """The command's arguments after `shardq`, optional parts and placeholders filled in."""
    command = re.sub(r"<([^>]+)>", lambda found: re.sub(r"[^a-z0-9]+", "-", found.group(1)), command)
    words = shlex.split(command.replace("[", " ").replace("]", " "))
    return [word for word in words[1:] if word != "..."]


def resolve(args: list[str]) -> tuple[click.Command, click.Context, list[str]]:
    """The (sub)command `shardq ARGS` runs, its parent context, and the arguments left for it."""
    args = list(args)
    context = click.Context(main, info_name="shardq")
    command: click.Command = main
    while isinstance(command, click.Group):
        name = args.pop(0)
        found = command.get_command(context, name)
        if found is None:
            raise click.UsageError(f"no command {name!r}")
        command = found
        context = click.Context(command, info_name=name, parent=context)
    return command, context, args


def parse(args: list[str]) -> None:
    """Make the context click would make for `shardq ARGS`; raises click's error if it cannot."""
    command, context, rest = resolve(args)
    command.make_context(str(context.command_path), rest)


LINES, QUOTED = documented_commands()


def test_the_readmes_document_commands_to_check() -> None:
    assert len(LINES) >= 20, LINES
    assert len(QUOTED) >= 5, QUOTED
    assert any(command.startswith("shardq redrive --from <dlq>") for command in QUOTED), QUOTED


@pytest.mark.parametrize("command", LINES)
def test_a_documented_command_line_parses(command: str) -> None:
    try:
        parse(arguments(command))
    except click.ClickException as refused:
        # An example path that is not on this machine: the option exists and was read.
        example_path = isinstance(refused, click.BadParameter) and "does not exist" in refused.message
        if not example_path:
            pytest.fail(f"{command}: {refused.format_message()}")


@pytest.mark.parametrize("command", QUOTED)
def test_the_options_a_quoted_command_names_exist(command: str) -> None:
    found, _, rest = resolve(arguments(command))
    known = {name for parameter in found.params for name in (*parameter.opts, *parameter.secondary_opts)}
    named = {word for word in rest if word.startswith("--")}
    assert named <= known, f"{command}: {sorted(named - known)} are not options of {found.name}"


def test_a_wrong_option_is_caught() -> None:
    """The checks above can fail: the runbook's old line is refused, as a line and quoted."""
    with pytest.raises(click.NoSuchOption):
        parse(arguments("shardq redrive --queue <dlq>"))
    found, _, _ = resolve(arguments("shardq redrive --queue <dlq>"))
    assert "--queue" not in {name for parameter in found.params for name in parameter.opts}
