"""Whether a result file still measures the code as it is.

    python -m experiments.freshness              # which published results the code has moved past
    python -m experiments.freshness --commands   # the command lines that re-run them

A result records the commit it ran on. The code it measures is its experiment module and every
module of this repository that module imports, directly or through others (``measured_files``:
``import`` statements anywhere in a file, functions included, followed through ``r3jax``, ``models``
and ``experiments``, and into ``r3jax/__main__.py`` where a file builds a ``[..., "-m", "r3jax", ...]``
command line: a server or trainer run in another process), plus the paths the module names in
``MEASURES`` (anything else it measures). A package's ``__init__`` counts only where it is the
module imported, not for each submodule under it.

A result is stale when one of those files differs in *code* between its commit and the working tree:
files are compared as syntax trees without docstrings, so comments, docstrings and formatting
leave a result current, and any other edit makes it stale (a file added or removed counts).
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("r3jax", "models", "experiments")


def _module_file(name: str, root: Path) -> Path | None:
    """The file of module ``name`` (``a/b.py`` or ``a/b/__init__.py``) under root, if it exists."""
    base = root.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _imports(path: Path, root: Path) -> set[Path]:
    """Files of this repository's modules that ``path`` imports, anywhere in it."""
    return {f for name in _imported_names(path.read_text()) if (f := _module_file(name, root)) is not None}


@functools.lru_cache(maxsize=None)
def _imported_names(text: str) -> tuple[str, ...]:
    """Names of this repository's modules a source text may import (cached by text)."""
    tree = ast.parse(text)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, (ast.List, ast.Tuple)):  # a command line: [..., "-m", "r3jax", ...]
            words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            names = [f"{w}.__main__" for m, w in zip(words, words[1:]) if m == "-m" and isinstance(w, str)]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] in PACKAGES)
    return tuple(sorted(out))


def _declared(path: Path) -> tuple[str, ...]:
    """The module's ``MEASURES = (...)`` literal (paths relative to the repository), or ()."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MEASURES"
                                                for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    return ()


def measured_files(module: str, root: Path = REPO) -> list[str]:
    """Repository-relative files the result of ``experiments.<module>`` measures (sorted)."""
    start = _module_file(f"experiments.{module}", root)
    if start is None:
        raise ValueError(f"experiments.{module}: no such experiment module under {root}")
    todo = [start] + [root / p for p in _declared(start)]
    seen: set[Path] = set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        if f.is_dir():
            todo.extend(sorted(f.rglob("*.py")))
            continue
        if not f.is_file():
            raise ValueError(f"experiments.{module}: MEASURES names {f.relative_to(root)}, which does not exist")
        seen.add(f)
        if f.suffix == ".py":
            todo.extend(_imports(f, root) - seen)
    return sorted(p.relative_to(root).as_posix() for p in seen)


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


@functools.lru_cache(maxsize=None)
def code_form(text: str | None, path: str) -> str | None:
    """What counts as the code of a file: a .py file's syntax tree without docstrings (comments and
    layout never reach it), any other file's text; None for a missing file."""
    if text is None or not path.endswith(".py"):
        return text
    try:
        return ast.dump(_strip_docstrings(ast.parse(text)))
    except SyntaxError:
        return text


def _git(*args: str, root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=60)


def has_commit(commit: str, root: Path = REPO) -> bool:
    """Whether this clone holds ``commit`` (a shallow clone may not)."""
    return _git("cat-file", "-e", f"{commit}^{{commit}}", root=root).returncode == 0


def _changed_at(commit: str, root: Path) -> frozenset[str]:
    """Tracked files whose text differs between ``commit`` and the working tree (not cached: the
    working tree moves)."""
    r = _git("diff", "--name-only", "--no-renames", commit, "--", root=root)
    if r.returncode:
        raise ValueError(f"git diff against {commit} failed: {r.stderr.strip()}")
    return frozenset(r.stdout.split())


@functools.lru_cache(maxsize=None)
def _files_at(commit: str, root: Path) -> frozenset[str]:
    r = _git("ls-tree", "-r", "--name-only", commit, root=root)
    if r.returncode:
        raise ValueError(f"git ls-tree {commit} failed: {r.stderr.strip()}")
    return frozenset(r.stdout.split())


@functools.lru_cache(maxsize=None)
def _text_at(commit: str, path: str, root: Path) -> str | None:
    r = _git("show", f"{commit}:{path}", root=root)
    return r.stdout if r.returncode == 0 else None


def changed_since(commit: str, files: list[str], root: Path = REPO) -> list[str]:
    """The files among ``files`` whose code differs between ``commit`` and the working tree."""
    out = []
    candidates = (set(files) & _changed_at(commit, root)) | (set(files) - _files_at(commit, root))  # + new files
    for path in sorted(candidates):
        now = root / path
        if code_form(_text_at(commit, path, root), path) != code_form(now.read_text() if now.exists() else None,
                                                                         path):
            out.append(path)
    return out


def stale(record: dict, module: str, root: Path = REPO) -> list[str]:
    """Files the result ``record`` of ``experiments.<module>`` measures whose code changed since the
    commit it records (every commit it names, for a grid filled over several); [] when current."""
    commits = record.get("commits") or [record["commit"]]
    files = measured_files(module, root)
    return sorted({f for c in commits for f in changed_since(c, files, root)})


def main(argv=None):
    import argparse

    from experiments import readme_tables

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commands", action="store_true",
                    help="print a shell command per result to re-run (stale or never published), nothing else")
    args = ap.parse_args(argv)
    width = max(len(s.name) for s in readme_tables.SECTIONS)
    for s in readme_tables.SECTIONS:
        d = readme_tables.load(s.name)
        changed = stale(d, s.module) if d is not None and readme_tables.is_clean(d) else None
        if args.commands:
            if changed is None or changed:
                command = s.command if s.command.startswith("make ") else (d or {}).get("command") or s.command
                # a grid keeps the runs it holds: a fresh one starts from an empty file
                aside = f"mv experiments/results/{s.name}.json /tmp/{s.name}.old.json && " if d and "commits" in d else ""
                print(f"{aside}{command}")
            continue
        print(f"{s.name:<{width}}  " + ("not published" if changed is None else
                                        f"stale ({len(changed)} files: {', '.join(changed[:4])}"
                                        f"{', ...' if len(changed) > 4 else ''})" if changed else "current"))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
