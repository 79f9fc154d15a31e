"""Source trees for bench/compare.py: the working tree, and a git worktree of one commit to
measure it against (made detached outside the working tree, reused when already there)."""
from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class CheckoutFailed(RuntimeError):
    """git could not resolve --checkout or make, reuse or remove its worktree."""


@dataclass(frozen=True)
class Tree:
    """Where a server's code comes from: the working tree as it is, or a worktree of one commit."""
    root: Path
    commit: str | None = None                  # None: the working tree, uncommitted edits included
    short: str = ""
    models_replaced: tuple[str, ...] = ()      # files of models/ copied over from the working tree

    @property
    def suffix(self) -> str:
        """What the names of this tree's servers end with: '@<short hash>', nothing for the working tree."""
        return f"@{self.short}" if self.commit else ""

    def place(self, path: str, within: Path = REPO) -> str:
        """`path` (relative ones from the working tree) made absolute; under `within`, a folder of the working
        tree, it moves to the same place in this tree."""
        resolved, folder = (REPO / path).resolve(), within.resolve()
        if not resolved.is_relative_to(folder):
            return str(resolved)
        return str(self.root / within.relative_to(REPO) / resolved.relative_to(folder))

    def describe(self) -> str:
        if self.commit:
            return f"worktree {self.root} at {self.commit}"
        return f"working tree {self.root} (uncommitted edits included)"


WORKING_TREE = Tree(REPO)


def git(*argv: str, cwd: Path = REPO) -> str:
    try:
        result = subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True)
    except OSError as exc:                     # no git, or cwd missing
        raise CheckoutFailed(f"git {' '.join(argv)}: {exc}") from exc
    if result.returncode != 0:
        raise CheckoutFailed(f"git {' '.join(argv)}: {result.stderr.strip() or f'status {result.returncode}'}")
    return result.stdout.strip()


def resolve_revision(rev: str) -> tuple[str, str]:
    """A commit, tag or branch -> (full hash, short hash)."""
    try:
        commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    except CheckoutFailed:
        raise CheckoutFailed(f"--checkout {rev}: not a commit of {REPO}") from None
    return commit, git("rev-parse", "--short", commit)


def default_checkout_dir(short: str) -> Path:
    # Outside the working tree, and named by the commit so that a kept worktree is found again.
    return Path(tempfile.gettempdir()) / f"tandem-checkout-{short}"


def open_worktree(commit: str, where: Path) -> bool:
    """Make `where` a detached worktree of `commit`, or reuse it if it is one already; True when reused."""
    if where.exists():
        check_reusable(where, commit)
        return True
    # --force: also when git still lists `where` as a worktree whose folder was deleted by hand.
    git("worktree", "add", "--force", "--detach", str(where), commit)
    return False


def check_reusable(where: Path, commit: str) -> None:
    """Refuse a folder that is not this repository's worktree at `commit` with its code unedited."""
    ours = git("rev-parse", "--path-format=absolute", "--git-common-dir")
    try:
        top = git("rev-parse", "--show-toplevel", cwd=where)
        common = git("rev-parse", "--path-format=absolute", "--git-common-dir", cwd=where)
        head = git("rev-parse", "HEAD", cwd=where)
    except CheckoutFailed:
        top = common = head = ""
    if Path(top) != where.resolve() or Path(common) != Path(ours) or head != commit:
        raise CheckoutFailed(f"{where} exists but is not a worktree of {REPO} at {commit[:12]}; "
                             "remove it or pass another --checkout-dir")
    # models/ may differ: it is mirrored from the working tree on every run.
    edits = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)models", cwd=where)
    if edits:
        raise CheckoutFailed(f"{where} has local edits, so it would not measure {commit[:12]}:\n{edits}")


def remove_worktree(where: Path) -> None:
    # --force: mirrored model files count as changes git would otherwise refuse to throw away.
    try:
        git("worktree", "remove", "--force", str(where))
    except CheckoutFailed as exc:
        print(f"warning: could not remove the worktree: {exc}", file=sys.stderr)


def mirror_files(source: Path, target: Path) -> list[str]:
    """Make target's files those of source: copy what differs, delete what source lacks; the paths changed."""
    wanted = {p.relative_to(source) for p in source.rglob("*") if p.is_file()}
    changed = []
    for relative in sorted(wanted):
        copy = target / relative
        if not copy.is_file() or not filecmp.cmp(source / relative, copy, shallow=False):
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / relative, copy)
            changed.append(str(relative))
    for extra in sorted(p for p in target.rglob("*") if p.is_file() and p.relative_to(target) not in wanted):
        extra.unlink()
        changed.append(str(extra.relative_to(target)))
    return changed
