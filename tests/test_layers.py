"""The layers of ``jaxmp/_src``: which private modules import which, read from their source.

The gradient functions' module should not need most of jaxmp: what a module
imports at import time (``import`` statements outside functions, followed
transitively within ``jaxmp._src``) is read with ``ast``, without importing
anything. Imports inside functions (deferred until the function runs) are
left out. And no module reads another module's private names: what one
module uses of another is that module's public interface.

Every ``.py`` file under ``jaxmp/_src`` counts as a module, by dotted name: a
package (``autocast/__init__.py``) is one, and each of its files another
(``autocast.rules``); relative imports are resolved from the importing
module's package, and importing a package's module imports the package too.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "jaxmp" / "_src"
PACKAGE = "jaxmp._src"


def _name(path: pathlib.Path) -> str:
    """The dotted name under ``jaxmp._src`` of a source file (a package's ``__init__.py``
    names the package; ``jaxmp/_src/__init__.py`` itself gives "")."""
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# Every module of jaxmp/_src, subpackages' modules included, by dotted name ("census";
# "autocast" for the package autocast/ and "autocast.rules" for a file of it); and which
# of them are packages.
MODULES = sorted(n for n in map(_name, SRC.rglob("*.py")) if n)
PACKAGES = frozenset(_name(p.parent / "__init__.py") for p in SRC.rglob("__init__.py")) - {""}


def _path(module: str) -> pathlib.Path:
    base = SRC.joinpath(*module.split("."))
    return base / "__init__.py" if module in PACKAGES else base.with_suffix(".py")


def _tree(module: str) -> ast.Module:
    path = _path(module)
    return ast.parse(path.read_text(), filename=str(path.relative_to(SRC)))


def _bindings(node: ast.AST, module: str, modules=None,
              packages=None) -> list[tuple[str, str, str | None]]:
    """``(bound name, jaxmp._src module, imported name or None)`` of an import statement in
    ``module``: ``None`` where the bound name is a module itself. Relative imports are
    resolved from ``module``'s package; ``modules`` and ``packages`` default to jaxmp/_src's."""
    modules = set(MODULES if modules is None else modules)
    packages = PACKAGES if packages is None else packages
    out = []
    if isinstance(node, ast.ImportFrom):
        if node.level == 0:
            if node.module != PACKAGE and not (node.module or "").startswith(PACKAGE + "."):
                return []
            base = node.module[len(PACKAGE) + 1:]
        else:
            here = module.split(".") if module in packages else module.split(".")[:-1]
            if node.level - 1 > len(here):
                return []  # above jaxmp._src
            here = here[:len(here) - (node.level - 1)]
            base = ".".join(here + ([node.module] if node.module else []))
        for a in node.names:
            sub = f"{base}.{a.name}" if base else a.name
            if sub in modules:  # a module: ``from jaxmp._src import census``
                out.append((a.asname or a.name, sub, None))
            elif base in modules:  # a name of a module: ``from jaxmp._src.census import x``
                out.append((a.asname or a.name, base, a.name))
    elif isinstance(node, ast.Import):
        for a in node.names:
            name = a.name[len(PACKAGE) + 1:] if a.name.startswith(PACKAGE + ".") else ""
            if name in modules:
                # ``import jaxmp._src.x`` binds ``jaxmp``; only ``as`` binds the module.
                out.append((a.asname or a.name, name, None))
    return out


def _with_packages(modules: set[str]) -> set[str]:
    """``modules`` and the packages above them, which Python imports first."""
    return {".".join(m.split(".")[:i]) for m in modules for i in range(1, m.count(".") + 2)}


def imports(module: str, *, deferred: bool = False) -> set[str]:
    """The ``jaxmp._src`` modules ``module`` imports: at import time, or also inside functions."""
    found = set()

    def visit(node, top):
        for child in ast.iter_child_nodes(node):
            if top or deferred:
                found.update(m for _, m, _ in _bindings(child, module))
            inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, top and not inner)

    visit(_tree(module), True)
    return _with_packages(found | {module}) - {module}


def closure(module: str, *, deferred: bool = False) -> set[str]:
    """``module`` and every ``jaxmp._src`` module it imports, transitively."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(imports(m, deferred=deferred))
    return seen


def private_reads(module: str, text: str | None = None) -> list[str]:
    """Where ``module`` reads a private name of another ``jaxmp._src`` module, as ``line: text``
    (``text``: that module's source, read from its file by default)."""
    tree = _tree(module) if text is None else ast.parse(text)
    aliases, out = set(), []
    for node in ast.walk(tree):
        for bound, other, name in _bindings(node, module):
            if other == module:
                continue
            if name is None:
                aliases.add(bound)
            elif name.startswith("_"):
                out.append(f"{node.lineno}: from {PACKAGE}.{other} import {name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            out.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return sorted(set(out), key=lambda s: int(s.split(":")[0]))


# What jaxmp/_src/grad.py (mp_value_and_grad, mp_grad) imports, itself included, after
# the scaler's alarms (alarms.py) and the widened gradient products (wide_gradients.py)
# were split from loss_scale.py and sharding.py, the float8 shortfall warning
# (shortfall.py, which imports the float8 package) from census.py, and the step's master-weights
# check moved from update.py (the optimizer updates, and optax) to kernel.py. Fewer is
# better: shrink it when a module leaves; a module that joins fails here.
GRAD_IMPORTS = {
    "grad", "kernel", "casting", "compat", "loss_scale", "alarms", "host", "sharding",
    # The step itself (kernel.py) runs the loss under the jaxpr interpreter, to count its
    # products (census, which names the user's lines with source.py) and to widen the
    # gradient sums XLA inserts (wide_gradients); its warnings are said once (messages).
    "census", "interpret", "wide_gradients", "source", "messages",
    # What they read jaxprs with (the walk, the FLOPs of a product, the dot_general
    # transposes, the leaf partition): one module for every tool (issue 35).
    "jaxprs",
}


def test_grad_imports_no_more_modules_than_listed():
    got = closure("grad")
    assert got <= GRAD_IMPORTS, f"grad.py now also imports {sorted(got - GRAD_IMPORTS)}"
    assert len(got) <= 14, sorted(got)


def test_grad_imports_at_most_half_of_src():
    assert len(closure("grad") - {"grad"}) <= len(MODULES) // 2, sorted(closure("grad"))


def test_device_averaging_and_the_scaler_need_no_interpreter():
    for module in ("sharding", "loss_scale", "alarms"):
        got = closure(module)
        assert not got & {"interpret", "wide_gradients", "kernel", "census"}, (module, got)
    assert closure("sharding") == {"sharding", "casting", "compat"}
    assert closure("loss_scale") == {"loss_scale", "alarms", "host", "casting", "sharding",
                                     "compat"}


def test_the_alarms_do_not_import_the_scaler():
    assert closure("alarms") == {"alarms", "host", "compat"}


@pytest.mark.parametrize("module", MODULES)
def test_no_module_reads_another_modules_private_names(module):
    assert not private_reads(module), "\n".join(private_reads(module))


def test_the_autocast_package_is_layered():
    # rules.py at the bottom; the analyses, the interpreter and the recompute pass each read
    # the rules and none of the others; the package's face (__init__.py) wires all four.
    def inside(module):
        return {m for m in imports(module) if m.startswith("autocast.")}

    parts = {"autocast.rules", "autocast.analysis", "autocast.interpreter", "autocast.recompute"}
    assert {m for m in MODULES if m.startswith("autocast.")} == parts
    assert inside("autocast.rules") == set()
    for module in parts - {"autocast.rules"}:
        assert inside(module) == {"autocast.rules"}, module
    assert inside("autocast") == parts


def _defines(module: str, name: str) -> bool:
    """Whether ``module`` assigns ``name`` at its top level."""
    return any(isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == name for t in node.targets)
        for node in _tree(module).body)


def test_the_float8_package_is_layered():
    # A recipe is a row: each recipe module defines its row (RECIPE) from the lower modules
    # alone, never from another recipe or the table; table.py collects the rows, and the
    # package's face (__init__.py) re-exports what the rest of jaxmp uses.
    def inside(module):
        return {m for m in imports(module) if m.startswith("float8.")}

    lower = {"float8.rules", "float8.scaling", "float8.target", "float8.recipe", "float8.blocks"}
    recipes = {m for m in MODULES if m.startswith("float8.") and _defines(m, "RECIPE")}
    assert recipes == {"float8.tensor", "float8.mxfp8", "float8.delayed", "float8.nvfp4"}
    parts = lower | recipes | {"float8.convolution", "float8.table"}
    assert {m for m in MODULES if m.startswith("float8.")} == parts
    for module in lower:
        assert inside(module) == set(), module
    assert inside("float8.convolution") == {"float8.rules", "float8.scaling"}
    for module in recipes:
        assert inside(module) <= lower | {"float8.convolution"}, module
        assert "float8.recipe" in inside(module), module
    assert inside("float8.table") == recipes | {"float8.recipe", "float8.target"}
    assert {m for m in closure("float8") if m.startswith("float8.")} == parts
    # No module of the package imports the package's face (only its modules).
    assert all("float8" not in _direct(m) for m in parts)


def _direct(module: str) -> set[str]:
    """The ``jaxmp._src`` modules ``module`` names in its import statements."""
    return {m for node in ast.walk(_tree(module)) for _, m, _ in _bindings(node, module)}


def test_the_helpers_see_the_imports_they_should():
    assert "kernel" in imports("grad") and "autocast" not in imports("kernel")
    assert "autocast" in imports("kernel", deferred=True)  # imported inside a function
    assert closure("grad") < closure("grad", deferred=True)
    reader = ("from jaxmp._src import census\n"
              "from jaxmp._src.diagnostics import _HALF_NAMES, matmul_flops\n"
              "def f(eqn):\n"
              "    return census._flops(eqn), census.census, census.__name__\n")
    assert private_reads("report", reader) == [
        "2: from jaxmp._src.diagnostics import _HALF_NAMES", "4: census._flops"]
    assert private_reads("census", reader) == ["2: from jaxmp._src.diagnostics import _HALF_NAMES"]


def test_the_helpers_read_a_package_by_its_modules():
    # A package's files (autocast/__init__.py, autocast/rules.py) are modules of their own,
    # relative imports resolved from the package (a made-up text: jaxmp's own use absolute ones).
    modules, packages = {"autocast", "autocast.rules", "census", "compat"}, {"autocast"}
    text = ("from jaxmp._src.autocast import rules\n"
            "from .rules import _narrow\n"
            "from .. import census\n"
            "from ..census import walk\n"
            "import jaxmp._src.compat as c\n"
            "from . import compat\n")
    read = lambda module: [b for node in ast.parse(text).body
                           for b in _bindings(node, module, modules, packages)]
    in_package = [("rules", "autocast.rules", None), ("_narrow", "autocast.rules", "_narrow"),
                  ("census", "census", None), ("walk", "census", "walk"), ("c", "compat", None)]
    # In autocast/__init__.py and autocast/rules.py "." is the package, ".." jaxmp._src.
    assert read("autocast") == in_package + [("compat", "autocast", "compat")]
    assert read("autocast.rules") == in_package + [("compat", "autocast", "compat")]
    # In a module of jaxmp._src itself, "." is jaxmp._src (".." is above it: not read).
    assert read("census") == [("rules", "autocast.rules", None), ("c", "compat", None),
                              ("compat", "compat", None)]
    # Importing a package's module imports the package first.
    assert _with_packages({"autocast.rules", "census"}) == {"autocast", "autocast.rules",
                                                            "census"}
    assert {"grad", "census", "shortfall"} <= set(MODULES) and "" not in MODULES


def _code_lines(node: ast.AST, lines: list[str]) -> int:
    """Lines of a definition that hold code: neither blank, nor a comment, nor its docstring."""
    body = [line for line in lines[node.lineno - 1:node.end_lineno]
            if line.strip() and not line.strip().startswith("#")]
    first = node.body[0]
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return len(body) - len([line for line in lines[first.lineno - 1:first.end_lineno]
                                if line.strip()])
    return len(body)


def test_no_function_is_longer_than_80_lines_of_code():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(node, lines)
                if n > 80:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "split these into functions of one task each:\n" + "\n".join(long)


def test_the_line_count_leaves_docstrings_and_comments_out():
    source = ('def f():\n    """Doc.\n\n    More.\n    """\n    # a comment\n\n'
              '    x = 1\n    return x\n')
    node = ast.parse(source).body[0]
    assert _code_lines(node, source.splitlines()) == 3  # def, x = 1, return


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _over(loop, attr: str) -> str | None:
    """The name ``e`` of a loop or generator ``for v in e.<attr>``, else ``None``."""
    it = loop.iter
    if (isinstance(loop.target, ast.Name) and isinstance(it, ast.Attribute) and it.attr == attr
            and isinstance(it.value, ast.Name)):
        return it.value.id
    return None


def hand_built_indexes(text: str) -> list[str]:
    """Where the source ``text`` builds a use/def index of a jaxpr by hand, as ``line: what``:
    a producer map (``{v: e for e in ... for v in e.outvars}``, or ``d[v] = e`` in a loop
    ``for v in e.outvars``: keyed by a result, valued by its equation or its index) or a users
    map (``d.setdefault(v, ...)`` in a loop ``for v in e.invars``). :class:`jaxmp._src.jaxprs.Uses`
    is the one index."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.DictComp) and isinstance(node.key, ast.Name):
            earlier: set = set()
            for g in node.generators:
                base = _over(g, "outvars")
                if (base and g.target.id == node.key.id
                        and _names(node.value) & (earlier | {base})):
                    found.append(f"{node.lineno}: a producer map")
                earlier |= _names(g.target)
        if not isinstance(node, ast.For):
            continue
        var = node.target.id if isinstance(node.target, ast.Name) else None
        for inner in ast.walk(node):
            base = _over(node, "outvars")
            if base and isinstance(inner, ast.Assign) and base in _names(inner.value) and any(
                    isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Name)
                    and t.slice.id == var for t in inner.targets):
                found.append(f"{inner.lineno}: a producer map")
            if (_over(node, "invars") and isinstance(inner, ast.Call)
                    and isinstance(inner.func, ast.Attribute) and inner.func.attr == "setdefault"
                    and inner.args and isinstance(inner.args[0], ast.Name)
                    and inner.args[0].id == var):
                found.append(f"{inner.lineno}: a users map")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


@pytest.mark.parametrize("module", [m for m in MODULES if m != "jaxprs"])
def test_one_use_def_index(module):
    found = hand_built_indexes(_path(module).read_text())
    assert not found, f"use jaxprs.Uses (or jaxprs.nested_producers) instead: {found}"


def test_the_index_guard_sees_hand_built_indexes():
    text = ("def f(jaxpr, producer, users, env):\n"
            "    by_var = {v: e for e in jaxpr.eqns for v in e.outvars}\n"
            "    for i, eqn in enumerate(jaxpr.eqns):\n"
            "        for v in eqn.outvars:\n"
            "            producer[v] = (eqn, ())\n"
            "        for v in eqn.invars:\n"
            "            users.setdefault(v, []).append(i)\n"
            "    by_index = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}\n"
            # Keyed by results, but not by what produced them: not an index.
            "    shapes = {v: v.aval for v in jaxpr.outvars}\n"
            "    for v in jaxpr.outvars:\n"
            "        env[v] = 0\n"
            "    return [v for e in jaxpr.eqns for v in e.outvars], by_var\n")
    assert hand_built_indexes(text) == ["2: a producer map", "5: a producer map",
                                        "7: a users map", "8: a producer map"]
    assert hand_built_indexes(_path("jaxprs").read_text())  # the one index is seen
