"""The layers of ``jaxmp/_src``: which private modules import which, read from their source.

The gradient functions' module should not need most of jaxmp: what a module
imports at import time (``import`` statements outside functions, followed
transitively within ``jaxmp._src``) is read with ``ast``, without importing
anything. Imports inside functions (deferred until the function runs) are
left out. And no module reads another module's private names: what one
module uses of another is that module's public interface.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "jaxmp" / "_src"
PACKAGE = "jaxmp._src"
MODULES = sorted(p.stem for p in SRC.glob("*.py") if p.stem != "__init__")


def _tree(module: str) -> ast.Module:
    return ast.parse((SRC / f"{module}.py").read_text(), filename=f"{module}.py")


def _bindings(node: ast.AST) -> list[tuple[str, str, str | None]]:
    """``(bound name, jaxmp._src module, imported name or None)`` of an import statement."""
    out = []
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == PACKAGE:
        out += [(a.asname or a.name, a.name, None) for a in node.names]
    elif (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
          and node.module.startswith(PACKAGE + ".")):
        module = node.module.split(".")[2]
        out += [(a.asname or a.name, module, a.name) for a in node.names]
    elif isinstance(node, ast.Import):
        for a in node.names:
            if a.name.startswith(PACKAGE + "."):
                # ``import jaxmp._src.x`` binds ``jaxmp``; only ``as`` binds the module.
                out.append((a.asname or a.name, a.name.split(".")[2], None))
    return [b for b in out if b[1] in MODULES]


def imports(module: str, *, deferred: bool = False) -> set[str]:
    """The ``jaxmp._src`` modules ``module`` imports: at import time, or also inside functions."""
    found = set()

    def visit(node, top):
        for child in ast.iter_child_nodes(node):
            if top or deferred:
                found.update(m for _, m, _ in _bindings(child))
            inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, top and not inner)

    visit(_tree(module), True)
    return found - {module}


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
        for bound, other, name in _bindings(node):
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
# were split from loss_scale.py and sharding.py, and the float8 shortfall warning
# (shortfall.py, which imports float8.py) from census.py. Fewer is better: shrink it when
# a module leaves; a module that joins fails here.
GRAD_IMPORTS = {
    "grad", "kernel", "casting", "compat", "loss_scale", "alarms", "host", "sharding", "update",
    # The step itself (kernel.py) runs the loss under the jaxpr interpreter, to count its
    # products (census, which names the user's lines with source.py) and to widen the
    # gradient sums XLA inserts (wide_gradients); its warnings are said once (messages).
    "census", "interpret", "wide_gradients", "source", "messages",
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
