"""Imports inside python/smp point one way (docs/architecture.md, "The Python package's
layers"). Reads the sources with `ast`; imports nothing of smp, starts no process.

Note [Import graph]
~~~~~~~~~~~~~~~~~~~
An arrow A -> B is any import in A of a module of the package: module-level and
function-local alike (a function-local import still makes A need B, only later), and
whatever it binds: `from smp.ranks import pp_rank` and `from smp import ranks` both
point at smp/ranks.py, `from smp.checkpoint import save` at smp/checkpoint/__init__.py,
`from smp import step` (a name smp/__init__.py defines, not a module) at
smp/__init__.py. Importing a submodule also runs its parents' __init__.py; that is
not an arrow (every module would otherwise point at smp/__init__.py, which imports
them all). The C++ extension `smp._C` is the bottom layer and imports nothing of
smp. It is imported by its own name (`import smp._C as _C`, `from smp._C import
ConfigError`), not as `from smp import _C`: that is the same import to Python, but
it reads as a name taken from the package's face, the one module above all the others,
and farm-studio draws it so (an arrow up to smp/__init__.py).

On top of the graph:
- no circle, whether its arrows are module-level or function-local;
- a function-local import (of anything) only with a `Note [...]` on its line or the
  few lines above it, saying why it is not at module level;
- every module is in exactly one layer of the list in docs/architecture.md, and
  every arrow runs from a layer to itself or to one below it.
"""
import ast
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT = os.path.join(REPO, "python")
PACKAGE = os.path.join(ROOT, "smp")
ARCHITECTURE = os.path.join(REPO, "docs", "architecture.md")
EXTENSION = "smp._C"
NOTE_LINES_ABOVE = 3  # how far above a function-local import its Note may stand


def _modules():
    """{module name: path} of every .py file under python/smp."""
    found = {}
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
            found[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


MODULES = _modules()


class Import:
    """One intra-package arrow: `source` imports `target` at `path`:`line`."""

    def __init__(self, source, target, path, line, local):
        self.source, self.target, self.path, self.line = source, target, path, line
        self.local = local  # inside a function

    def __str__(self):
        where = "function-local" if self.local else "module-level"
        return f"{self.source} -> {self.target} ({os.path.relpath(self.path, REPO)}:{self.line}, {where})"


def _known(name):
    return name in MODULES or name == EXTENSION


def _owner(name):
    """The module that `name` (a module, or a name inside one) comes from."""
    parts = name.split(".")
    while parts and not _known(".".join(parts)):
        parts.pop()
    return ".".join(parts) if parts else None


def _functions_of(tree):
    """{id(node): True} for every node inside a function (def or lambda)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for child in ast.walk(node):
                if child is not node:
                    inside.add(id(child))
    return inside


def _parse(name):
    path = MODULES[name]
    with open(path) as fh:
        text = fh.read()
    return path, text, ast.parse(text, path)


def _base_of(node, name):
    """The absolute module a `from ... import` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = name if MODULES[name].endswith("__init__.py") else name.rsplit(".", 1)[0]
    parts = package.split(".")
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _imports():
    """Every intra-package arrow of python/smp (Note [Import graph])."""
    arrows = []
    for name in MODULES:
        path, _, tree = _parse(name)
        inside = _functions_of(tree)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [_owner(a.name) for a in node.names if a.name.split(".")[0] == "smp"]
            elif isinstance(node, ast.ImportFrom):
                base = _base_of(node, name)
                if base.split(".")[0] != "smp":
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if _known(full):
                        targets.append(full)
                    else:  # a name the module `base` (or its package) defines
                        targets.append(_owner(base))
            for target in targets:
                if target is not None and target != name:
                    arrows.append(Import(name, target, path, node.lineno, id(node) in inside))
    return arrows


ARROWS = _imports()


def _cycle(arrows):
    """One circle of `arrows` as a list of arrows, or None."""
    out = {}
    for a in arrows:
        out.setdefault(a.source, []).append(a)
    state = {}  # module -> 1 while on the path, 2 when done
    path = []

    def visit(module):
        state[module] = 1
        for a in out.get(module, ()):
            path.append(a)
            if state.get(a.target) == 1:
                start = next(i for i, p in enumerate(path) if p.source == a.target)
                return path[start:]
            if a.target not in state:
                found = visit(a.target)
                if found:
                    return found
            path.pop()
        state[module] = 2
        return None

    for module in sorted(out):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_the_graph_sees_the_package():
    # The checks below are only as good as the graph: it must see the package's
    # well-known arrows (a parse that found nothing would pass every check).
    assert {"smp", "smp.core", "smp.step", "smp.runtime", "smp.checkpoint"} <= set(MODULES)
    pairs = {(a.source, a.target) for a in ARROWS}
    assert ("smp.step", "smp.checkpoint") in pairs
    assert ("smp.runtime", "smp.auto_resume") in pairs
    assert ("smp.checkpoint._api", "smp.checkpoint._commit") in pairs
    assert ("smp.ranks", EXTENSION) not in pairs and ("smp.groups", EXTENSION) in pairs


def test_no_import_circle():
    circle = _cycle(ARROWS)
    assert circle is None, (
        "python/smp imports in a circle (Note [Import graph] in tests/python/test_imports.py): "
        + "; ".join(str(a) for a in circle)
        + ". Move what the lower module needs below it, or let the higher one pass it down.")


def test_the_cycle_finder_finds_a_circle():
    a = Import("x", "y", "x.py", 1, False)
    b = Import("y", "z", "y.py", 2, True)
    c = Import("z", "x", "z.py", 3, False)
    assert [str(i) for i in _cycle([a, b, c])] == [str(a), str(b), str(c)]
    assert _cycle([a, b]) is None


def test_a_function_local_import_says_why_in_a_note():
    bare = []
    for name in MODULES:
        path, text, tree = _parse(name)
        lines = text.split("\n")
        inside = _functions_of(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) in inside:
                above = lines[max(0, node.lineno - 1 - NOTE_LINES_ABOVE):node.end_lineno]
                if not any("Note [" in line for line in above):
                    bare.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: "
                                f"{ast.unparse(node)}")
    assert not bare, (
        "function-local imports without a Note [...] on their line or the "
        f"{NOTE_LINES_ABOVE} lines above saying why they are not at module level: "
        + "; ".join(bare))


def test_the_extension_is_imported_by_its_own_name():
    through_face = []
    for name in MODULES:
        path, _, tree = _parse(name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.ImportFrom) and _base_of(node, name) == "smp"
                    and any(a.name == "_C" for a in node.names)):
                through_face.append(f"{os.path.relpath(path, REPO)}:{node.lineno}")
    assert not through_face, (
        "`from smp import _C` takes the extension through smp/__init__.py; write "
        "`import smp._C as _C` (Note [Import graph]): " + ", ".join(through_face))


def _layers():
    """[(layer, [module, ...]), ...] top to bottom, from the ```layers block of
    docs/architecture.md. A word is a path under python/smp without `.py`; `x/` is the
    package x and every module under it; `__init__` is smp itself."""
    with open(ARCHITECTURE) as fh:
        text = fh.read()
    blocks = re.findall(r"^```layers\n(.*?)^```", text, re.M | re.S)
    assert len(blocks) == 1, "docs/architecture.md must hold one ```layers block"
    layers = []
    for line in blocks[0].split("\n"):
        line = line.split("#", 1)[0]
        if not line.strip():
            continue
        words = line.split()
        if not line[0].isspace():
            layers.append((words.pop(0).rstrip(":"), []))
        for word in words:
            layers[-1][1].append(word)
    return layers


def _expand(word):
    if word == "__init__":
        return ["smp"]
    if word == "_C":
        return [EXTENSION]
    if word.endswith("/"):
        package = "smp." + word.rstrip("/").replace("/", ".")
        return [m for m in MODULES if m == package or m.startswith(package + ".")]
    name = "smp." + word.replace("/", ".")
    return [name] if name in MODULES else []


def test_every_module_is_in_one_layer():
    seen, unknown = {}, []
    for layer, words in _layers():
        for word in words:
            expanded = _expand(word)
            if not expanded:
                unknown.append(word)
            for module in expanded:
                assert module not in seen, (
                    f"{module} is in layers '{seen[module]}' and '{layer}' of "
                    "docs/architecture.md")
                seen[module] = layer
    assert not unknown, f"docs/architecture.md's layers name no module: {unknown}"
    missing = sorted(set(MODULES) - set(seen))
    assert not missing, f"modules in no layer of docs/architecture.md: {missing}"


def test_every_import_points_down_the_layers():
    order = {}
    for i, (_, words) in enumerate(_layers()):
        for word in words:
            for module in _expand(word):
                order[module] = i
    names = [layer for layer, _ in _layers()]
    up = [f"{a} goes up from '{names[order[a.source]]}' to '{names[order[a.target]]}'"
          for a in ARROWS
          if a.source in order and a.target in order and order[a.target] < order[a.source]]
    assert not up, ("imports against the layers of docs/architecture.md (a module imports "
                    "its own layer or those below it): " + "; ".join(up))


@pytest.mark.parametrize("source, expected", [
    ("from smp import ranks", "smp.ranks"),
    ("from smp.ranks import pp_rank", "smp.ranks"),
    ("from smp import nested", "smp.nested"),
    ("from smp import DistributedModel", "smp"),
    ("from smp.checkpoint import save", "smp.checkpoint"),
    ("from smp.checkpoint import _read", "smp.checkpoint._read"),
    ("import smp._C as _C", EXTENSION),
    ("from smp import _C", EXTENSION),
    ("from smp._C import ConfigError", EXTENSION),
    ("import smp.ddp_comm_hooks._groups", "smp.ddp_comm_hooks._groups"),
])
def test_an_import_points_at_the_module_it_names(source, expected, monkeypatch, tmp_path):
    module = tmp_path / "probe.py"
    module.write_text(f"def f():\n    {source}\n")
    monkeypatch.setitem(MODULES, "smp.probe", str(module))
    arrows = [a for a in _imports() if a.source == "smp.probe"]
    assert [(a.target, a.line, a.local) for a in arrows] == [(expected, 2, True)]
