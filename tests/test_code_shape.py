"""The shape the serving code keeps (docs/architecture.md): no function in server/ engine/ spec/ devices/
longer than a screen. Read with `ast`, so it needs no import of what it checks."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDERS = ("server", "engine", "spec", "devices")
MAX_FUNCTION_LINES = 40


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function and method, nested ones too: from its `def` line to
    its last line, blank lines and comments inside included (decorators not)."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child.lineno, child.end_lineno - child.lineno + 1))
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)
    visit(ast.parse(source), "")
    return found


def long_functions(root: Path = REPO, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    return [f"{path.relative_to(root)}:{line} {name} is {length} lines"
            for folder in FOLDERS for path in sorted((root / folder).rglob("*.py"))
            for name, line, length in function_lengths(path.read_text()) if length > limit]


def test_no_function_is_longer_than_forty_lines():
    offenders = long_functions()
    assert not offenders, f"over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)


def test_lengths_count_every_line_from_def_to_the_end():
    lines = [f"    x{i} = {i}\n" for i in range(39)]
    source = ("def over():\n" + "".join(lines[:20]) + "\n" + "".join(lines[20:]) +    # 41: the blank inside counts
              "\n"
              "class Box:\n"
              "    @property\n"
              "    def size(self):\n"
              "        def inner():\n"
              "            return 1\n"
              "\n"
              "        return inner()\n"
              "\n"
              "async def tail():\n"
              "    # a comment\n"
              "    pass\n")
    assert function_lengths(source) == [("over", 1, 41), ("Box.size", 45, 5), ("Box.size.inner", 46, 2),
                                        ("tail", 51, 3)]


def test_an_offender_is_named_with_its_file_line_and_length(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "long.py").write_text("def short():\n    pass\n\n\ndef long():\n" + "    pass\n" * 40)
    assert long_functions(tmp_path) == ["engine/long.py:5 long is 41 lines"]
    assert long_functions(tmp_path, limit=41) == []
