"""Render run.py's flags (engine/args.py: build_parser) as markdown: one table per argparse group, each
row a flag, its default and its help, in the parser's order.

    python tools/flags_doc.py > docs/flags.md

tests/test_docs.py checks that docs/flags.md is this script's output, so a flag added or reworded in
engine/args.py without regenerating the page fails the tests.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.args import build_parser  # noqa: E402

HEADER = """# Flags

Generated from `python run.py --help` by `python tools/flags_doc.py > docs/flags.md`: change a flag's
help in `engine/args.py` and regenerate this page (`tests/test_docs.py` fails while it is stale). Names
follow SGLang's where the concept is the same.
"""

TYPE_NAMES = {int: "INT", float: "FLOAT", str: "TEXT", str.lower: "TEXT"}


def cell(text: str) -> str:
    """Text made safe for one markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def flag_cell(action: argparse.Action) -> str:
    """The flag as a user types it: its values' choices or kind, repeated or several."""
    name = action.option_strings[-1]
    if action.nargs == 0:
        return f"`{name}`"
    if action.choices:
        value = "\\|".join(str(choice) for choice in action.choices)
    else:
        value = TYPE_NAMES.get(action.type, "TEXT")
    if action.nargs == "+":
        return f"`{name} {value} [{value} ...]`"
    if isinstance(action, argparse._AppendAction):
        return f"`{name} {value}` (repeatable)"
    return f"`{name} {value}`"


def default_cell(action: argparse.Action) -> str:
    """The value the flag takes when it is not given; none where argparse has none."""
    if action.nargs == 0:
        return "off"
    if action.default is None:
        return "–"
    default = str(action.default)
    if default.startswith(f"{ROOT}/"):         # the embedded model: the same page from every checkout
        default = default[len(f"{ROOT}/"):]
    return f"`{default}`"


def help_cell(action: argparse.Action, prog: str) -> str:
    """The help as --help prints it (its %-placeholders filled), without the appended default."""
    text = action.help or ""
    if "%" in text:
        text = text % dict(vars(action), prog=prog)
    return cell(text)


def group_table(group: argparse._ArgumentGroup, prog: str) -> str:
    """One group's flags as a table, --help itself left out."""
    actions = [action for action in group._group_actions if not isinstance(action, argparse._HelpAction)]
    if not actions:
        return ""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    rows += [f"| {flag_cell(a)} | {default_cell(a)} | {help_cell(a, prog)} |" for a in actions]
    title = group.title[0].upper() + group.title[1:] if group.title else "Flags"
    return f"## {title}\n\n" + "\n".join(rows) + "\n"


def render(parser: argparse.ArgumentParser) -> str:
    """The whole page: the header, then a table per group that has flags."""
    tables = [group_table(group, parser.prog) for group in parser._action_groups]
    return "\n".join([HEADER] + [table for table in tables if table])


def main() -> None:
    sys.stdout.write(render(build_parser()))


if __name__ == "__main__":
    main()
