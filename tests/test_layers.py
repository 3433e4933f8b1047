"""The package's layers, read from its source with ``ast`` (no import runs).

Each package's ``__init__.py`` docstring names the packages it may import on
a line ``May import: a, b.`` (``none`` for none), and optionally the ones it
reaches only inside a function, at the moment of use, on a line ``May import
on use: c.``. Names are relative to ``torchtitan_grpo``: ``server.engine``.
The rules the test holds every module to:

* a module may import its own package, that package's subpackages, and the
  root's shared helpers (``aio``, ``net``, ``reasons``, ...), never
  ``session`` (the top);
* any other package it imports must be named in its package's docstring; an
  entry names that package and its subpackages, except an entry naming an
  enclosing package (``server`` in ``server.routes``), which means its own
  modules only;
* no two modules import each other, directly or around a loop (imports inside
  functions count: they are how a circle hides).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "torchtitan_grpo"
NAME = "torchtitan_grpo"


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _package(mods: dict[str, Path], mod: str) -> str:
    return mod if mods[mod].name == "__init__.py" else mod.rpartition(".")[0]


def _imports(mods: dict[str, Path], mod: str) -> list[tuple[str, int, bool]]:
    """``(imported module, line, inside a function)`` for each of ``mod``'s imports of the package."""
    pkg = _package(mods, mod)
    tree = ast.parse(mods[mod].read_text(), filename=str(mods[mod]))
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            lazy = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, lazy) for a in child.names if a.name in mods)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the package, up level - 1
                    up = pkg.split(".")[:len(pkg.split(".")) - (child.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                for a in child.names:
                    target = f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                    if target in mods:
                        out.append((target, child.lineno, lazy))
            visit(child, lazy)

    visit(tree, False)
    return sorted({(t, line, lazy) for t, line, lazy in out if t != mod})


def _allowed(doc: str | None) -> tuple[set[str], set[str]] | None:
    """The ``May import`` entries of a package docstring and its ``on use`` ones; None without the line."""
    text = " ".join((doc or "").split())
    found = re.search(r"May import: (.*?)\.(?:\s|$)", text)
    if found is None:
        return None
    on_use = re.search(r"May import on use: (.*?)\.(?:\s|$)", text)

    def names(m):
        return {n.strip() for n in m.group(1).split(",") if n.strip() and n.strip() != "none"} if m else set()
    return names(found), names(on_use)


def _entry_allows(entry: str, pkg: str, target_pkg: str) -> bool:
    if target_pkg == entry:
        return True
    encloses = pkg == entry or pkg.startswith(entry + ".")
    return target_pkg.startswith(entry + ".") and not encloses


def layer_errors(root: Path = ROOT) -> list[str]:
    """Every import that its package's docstring does not allow, and every package without the line."""
    mods = _modules(root)
    name = root.name
    errors, rules = [], {}
    for mod, path in mods.items():
        if path.name == "__init__.py":
            rule = _allowed(ast.get_docstring(ast.parse(path.read_text())))
            if rule is None:
                errors.append(f"{mod}: its __init__.py docstring has no 'May import: ...' line")
            rules[mod] = rule or (set(), set())
    for mod in mods:
        pkg = _package(mods, mod)
        local = pkg[len(name) + 1:] if pkg != name else ""
        allowed, on_use = rules.get(pkg, (set(), set()))
        for target, line, lazy in _imports(mods, mod):
            tpkg = _package(mods, target)
            if target == f"{name}.session" and mod != target:
                errors.append(f"{mod}:{line} imports {target}: nothing imports the session")
                continue
            if tpkg == pkg or tpkg == name or tpkg.startswith(pkg + ".") and pkg != name:
                continue
            rel = tpkg[len(name) + 1:]
            if any(_entry_allows(e, local, rel) for e in allowed):
                continue
            if lazy and any(_entry_allows(e, local, rel) for e in on_use):
                continue
            errors.append(f"{mod}:{line} imports {target}{' (inside a function)' if lazy else ''}: "
                          f"{local or 'the root'}'s docstring does not allow {rel}")
    return errors


def import_circles(root: Path = ROOT) -> list[list[str]]:
    """Each set of modules that import one another around a loop (Tarjan's strongly connected components)."""
    mods = _modules(root)
    edges = {m: sorted({t for t, _, _ in _imports(mods, m)}) for m in mods}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in edges:
        if v not in index:
            connect(v)
    return circles


def test_every_package_imports_only_what_its_docstring_allows():
    errors = layer_errors()
    assert not errors, "\n".join(errors)


def test_no_two_modules_import_each_other_directly_or_around_a_loop():
    circles = import_circles()
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def test_no_module_at_the_root_beyond_the_session_and_a_few_helpers_and_none_over_600_lines():
    at_root = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(at_root) <= 12, at_root
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def toy(tmp_path):
    """A tiny package laid out like ours: a low ``config``, a higher ``train``, a helper at the root."""
    return _write(tmp_path / "pkg", {
        "__init__.py": '"""Root. May import: config, train."""\n',
        "helpers.py": "",
        "session.py": "from pkg.train import step\n",
        "config/__init__.py": '"""Sections. May import: none. May import on use: train."""\n',
        "config/job.py": "from pkg import helpers\n",
        "train/__init__.py": '"""The step. May import: config."""\n',
        "train/step.py": "from pkg.config import job\n",
    })


def test_the_checks_pass_a_clean_package(toy):
    assert layer_errors(toy) == [] and import_circles(toy) == []


def test_an_import_its_docstring_does_not_allow_fails(toy):
    (toy / "config/job.py").write_text("from pkg.train import step\n")
    assert any("pkg.config.job:1 imports pkg.train.step" in e for e in layer_errors(toy))
    (toy / "config/job.py").write_text("def f():\n    from pkg.train import step\n")
    assert layer_errors(toy) == []  # the docstring allows it on use
    (toy / "config/job.py").write_text("from pkg import session\n")
    assert any("nothing imports the session" in e for e in layer_errors(toy))


def test_circles_fail_directly_and_around_a_loop_even_inside_functions(toy):
    (toy / "config/a.py").write_text("from pkg.config import b\n")
    (toy / "config/b.py").write_text("def f():\n    from pkg.config import a\n")
    assert import_circles(toy) == [["pkg.config.a", "pkg.config.b"]]
    (toy / "config/b.py").write_text("from pkg.config import c\n")
    (toy / "config/c.py").write_text("import pkg.config.a\n")
    assert import_circles(toy) == [["pkg.config.a", "pkg.config.b", "pkg.config.c"]]
