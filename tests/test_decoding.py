"""The model runner holds one decoding (engine/decoding.py) and calls it without asking what it
is: speculation lives behind that interface and in spec/, so engine/ names no spec worker and
reads nothing of the speculative plan but what engine/batch.py's DecodePlan declares."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    """Every module the file imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_model_runner_mentions_no_spec_worker():
    source = (ROOT / "engine" / "model_runner.py").read_text()
    assert "worker" not in source.lower()
    assert not [m for m in imported_modules(ROOT / "engine" / "model_runner.py") if m.split(".")[0] == "spec"]


def test_engine_reaches_spec_only_through_the_decoding_registry():
    importers = {path.relative_to(ROOT).as_posix() for path in (ROOT / "engine").rglob("*.py")
                 if any(m.split(".")[0] == "spec" for m in imported_modules(path))}
    assert importers == {"engine/decoding.py"}
