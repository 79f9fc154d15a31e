"""The documents stay true to the tree: docs/flags.md is the parser's, every result file is quoted by a
document and every result a document quotes is there, and every relative link resolves. No server runs.

A document names a result file by its path (`bench/results/history/hf.txt`, or `bench/results/history/soak_kill.*`
for the files of one run), or by its bare name in backticks (`hf.txt`, `soak_kill.*`) where it names the file's
folder (`bench/results/history/`) somewhere else in its text.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RESULT_PATH = re.compile(r"bench/results/[\w./*-]*")
BARE_NAME = re.compile(r"`([\w-]+\.(?:jsonl|json|txt|png|\*))`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def documents() -> list[Path]:
    """What counts as the project's documentation: the README and docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def result_files() -> set[Path]:
    """Every result file, the index excepted."""
    return {path for path in RESULTS.rglob("*") if path.is_file() and path != RESULTS / "README.md"}


def folders_named(text: str) -> set[Path]:
    """Result folders below bench/results/ that a document names, itself or through a file in it."""
    folders = set()
    for ref in RESULT_PATH.findall(text):
        path = ROOT / ref
        folder = path if ref.endswith("/") or path.is_dir() else path.parent
        if folder != RESULTS and RESULTS in folder.parents:
            folders.add(folder)
    return folders


def references(text: str) -> dict[str, set[Path]]:
    """Each result a document quotes, as written, with the files it stands for (none when it is missing)."""
    refs = {ref: set(ROOT.glob(ref)) for ref in RESULT_PATH.findall(text) if not ref.endswith("/")}
    for name in BARE_NAME.findall(text):
        refs[name] = {path for folder in folders_named(text) for path in folder.glob(name)}
    return {ref: {path for path in paths if path.is_file()} for ref, paths in refs.items()}


def quoted_results() -> dict[Path, dict[str, set[Path]]]:
    return {doc: references(doc.read_text()) for doc in documents()}


def test_flags_page_is_the_generator_s_output():
    generated = subprocess.run([sys.executable, str(ROOT / "tools" / "flags_doc.py")], capture_output=True,
                               text=True, check=True, cwd=ROOT).stdout
    assert (ROOT / "docs" / "flags.md").read_text() == generated, \
        "docs/flags.md is stale: python tools/flags_doc.py > docs/flags.md"


def test_every_result_file_is_quoted_by_a_document():
    quoted = {path for refs in quoted_results().values() for paths in refs.values() for path in paths}
    unquoted = sorted(str(path.relative_to(ROOT)) for path in result_files() - quoted)
    assert not unquoted, f"result files no document names (git rm them, or quote them): {unquoted}"


def test_every_result_a_document_quotes_exists():
    missing = [f"{doc.relative_to(ROOT)}: {ref}" for doc, refs in quoted_results().items()
               for ref, paths in refs.items() if not paths]
    assert not missing, f"results named but not in bench/results/: {missing}"


def test_every_relative_link_resolves():
    broken = []
    for doc in documents():
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)      # code blocks hold no links
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:|#", target):                            # a URL, or a place on the same page
                continue
            if not (doc.parent / target.split("#")[0]).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, f"links to files that are not there: {broken}"


def test_the_checks_see_what_they_check():
    """The rules above match something: a rule that matched nothing would pass whatever the documents say."""
    history = (ROOT / "docs" / "performance-history.md").read_text()
    assert RESULTS / "history" in folders_named(history)
    assert references("`hf.txt` in `bench/results/history/`")["hf.txt"] == {RESULTS / "history" / "hf.txt"}
    assert references("`hf.txt` with no folder named")["hf.txt"] == set()
    assert sum(len(LINK.findall(doc.read_text())) for doc in documents()) > 10
