"""The one place where jaxmp meets JAX's internals (jaxmp/_src/compat.py)."""

import ast
import os
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core
from jax.interpreters import ad
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

import jaxmp
from jaxmp._src import compat
from jaxmp._src import host
from jaxmp._src import interpret

ROOT = pathlib.Path(__file__).resolve().parents[1]

_INTERNAL_MODULES = ("jax._src", "jax.core", "jax.extend", "jax.interpreters")
# Attributes of equations (their parameters, name stacks and tracebacks) and of tracers.
_EQUATION_ATTRIBUTES = {"params": "an equation's parameters",
                        "source_info": "an equation's name stack or traceback"}


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def reaches_around(source: str) -> list[str]:
    """The places where the module ``source`` touches JAX's internals itself (line: what)."""
    found = []
    internal = lambda name: any(name == m or name.startswith(m + ".") for m in _INTERNAL_MODULES)
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if internal(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [f"{module}.{a.name}" for a in node.names]
            found += [f"{line}: from {module} import {n.rsplit('.', 1)[1]}"
                      for n in names if internal(module) or internal(n)]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if internal(dotted) and not internal(dotted.rsplit(".", 1)[0]):
                found.append(f"{line}: {dotted}")
            elif node.attr in _EQUATION_ATTRIBUTES:
                found.append(f"{line}: .{node.attr} ({_EQUATION_ATTRIBUTES[node.attr]})")
            elif node.attr == "bind" and dotted not in ("interpret.bind", "compat.bind"):
                found.append(f"{line}: {dotted} (binds a primitive)")
            elif node.attr.endswith("_p") and dotted.split(".")[0] in ("jax", "lax"):
                found.append(f"{line}: {dotted} (a primitive)")
            elif node.attr.endswith("Tracer"):
                found.append(f"{line}: {dotted} (a tracer class)")
    return found


def primitive_sets(source: str, primitives: frozenset) -> list[str]:
    """The sets, tuples and lists of primitive names (two or more) written in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
            names = [e.value for e in node.elts
                     if isinstance(e, ast.Constant) and e.value in primitives]
            if len(names) >= 2:
                found.append(f"{node.lineno}: {names}")
    return found


# Modules that read XLA's optimized HLO text, whose opcodes (copy, slice, while, ...) share
# names with JAX primitives but are XLA's, not JAX's: no set of primitive names there.
HLO_READERS = {"hlo.py", "gpu_program.py"}


def test_no_module_but_compat_touches_jax_internals():
    """Equation parameters, name stacks, binding, tracers, jax.core, jax.extend and sets of
    primitive names: in compat.py only."""
    offenders = {}
    primitives = compat.installed_primitives() | set(compat.LEGACY_PRIMITIVES)
    for path in sorted((ROOT / "jaxmp").rglob("*.py")):
        if path.name == "compat.py":
            continue
        found = reaches_around(path.read_text())
        if path.name not in HLO_READERS:
            found += primitive_sets(path.read_text(), primitives)
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, (
        "These modules reach into JAX's internals themselves; add a typed accessor to "
        f"jaxmp/_src/compat.py and call it instead: {offenders}")


def test_the_guard_sees_every_way_around_compat():
    source = """
import jax
import jax.extend
from jax.extend import core
from jax import core as jax_core
from jax._src import source_info_util
from jax import lax

def f(eqn, x):
    n = eqn.params["num_consts"]
    k = eqn.params.get("length", 1)
    stack = str(eqn.source_info.name_stack)
    y = eqn.primitive.bind(x, **eqn.params)
    z = lax.conv_general_dilated_p
    t = isinstance(x, jax.core.Tracer)
    return interpret.bind(eqn, [x]), compat.bind(eqn, [x])
"""
    found = reaches_around(source)
    lines = sorted({int(f.split(":")[0]) for f in found})
    # Every line of f but its last (jaxmp's own binding functions) and the import of jax.lax.
    assert lines == [3, 4, 5, 6, 10, 11, 12, 13, 14, 15], found
    assert reaches_around("import jax\nfrom jax import lax\nx = jax.numpy.ones(2)\n") == []
    primitives = frozenset({"scan", "while", "cond", "exp"})
    assert primitive_sets("a = name in ('scan', 'while')\nb = {'exp', 'x'}\nc = ['cond']\n",
                          primitives) == ["1: ['scan', 'while']"]


def test_every_primitive_name_is_a_primitive_of_this_jax_or_a_dated_legacy_name():
    installed = compat.installed_primitives()
    assert {"dot_general", "scan", "while", "cond", "psum", "remat2"} <= installed
    tables = {**compat.TABLES, "interpret.HANDLERS": interpret.HANDLERS,
              "interpret eager handlers": interpret.eager_handlers()}
    for name, table in tables.items():
        names = set(table)
        if name == "UNVARYING":
            names |= {v for v in table.values() if v is not None}
        unknown = names - installed - set(compat.LEGACY_PRIMITIVES)
        assert not unknown, (
            f"compat.{name}: {sorted(unknown)} are not primitives of jax {jax.__version__}; "
            "remove them, or add them to compat.LEGACY_PRIMITIVES with the releases that bind them")
    for name, note in compat.LEGACY_PRIMITIVES.items():
        assert re.search(r"jax \d+\.\d+", note) and re.search(r"\b20\d\d\b", note), (name, note)
    assert "copy_p" not in jaxmp.autocast.FOLLOW and "expand_dims" not in jaxmp.autocast.FOLLOW


def test_the_tables_are_the_rules_autocast_uses():
    assert jaxmp.AutocastRules().follow is compat.FOLLOW
    assert jaxmp.autocast.FULL_PRECISION is compat.FULL_PRECISION


def test_scan_parameters_are_read_on_every_jax():
    def f(c0, xs, k):
        return jax.lax.scan(lambda c, x: (c * k + x, c + 1.0), c0, xs, reverse=True)

    eqn = _eqn(f, 1.0, jnp.ones(3), 2.0)
    p = compat.scan(eqn)
    assert (p.num_consts, p.num_carry, p.length, p.reverse) == (1, 1, 3, True)
    assert len(p.body.jaxpr.invars) == 3 and len(p.body.consts) == 0


def test_an_accessor_that_does_not_find_its_parameter_says_which_not_a_key_error():
    eqn = _eqn(lambda x: jnp.sum(x, axis=1), jnp.ones((2, 3)))
    with pytest.raises(compat.UnknownEquation, match="reduce_sum equation has no parameter "
                                                     "'num_consts' or 'ft_in'.*axes") as caught:
        compat.scan(eqn)
    assert caught.value.primitive == "reduce_sum" and not isinstance(caught.value, KeyError)


@pytest.mark.parametrize("stack, backward, depth", [
    ("jvp(Net)/Dense_0", False, 0), ("transpose(jvp(Net))/Dense_0", True, 1),
    ("transpose(jvp(f))/transpose(jvp(rule))", True, 2), ("transpose_layer/Dense", False, 0)])
def test_backward_pass_from_the_name_stack(stack, backward, depth):
    assert compat.is_backward(stack) is backward and compat.transpose_depth(stack) == depth


def test_the_backward_pass_of_grad_is_under_a_transpose():
    def loss(w, x):
        with jax.named_scope("layer"):
            return jnp.sum(jnp.sin(x @ w))

    closed = jax.make_jaxpr(jax.grad(loss))(jnp.ones((3, 3)), jnp.ones((2, 3)))
    stacks = [compat.name_stack(e) for e in closed.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert [compat.is_backward(s) for s in stacks] == [False, True]
    assert [compat.without_transforms(s) for s in stacks] == ["layer", "layer"]
    assert compat.without_transforms("jit") == "" and compat.without_transforms("scan") == ""


# --- Unknown is not a crash ------------------------------------------------------------------


def _primitive(name, run):
    """A primitive of the test's own, ``name``, that JAX runs as ``run(*args, **params)``."""
    prim = jex_core.Primitive(name)
    prim.multiple_results = True
    prim.def_impl(run)
    prim.def_abstract_eval(lambda *avals, **params: [
        jax.core.ShapedArray(o.shape, o.dtype)
        for o in jax.eval_shape(lambda *a: run(*a, **params), *avals)])
    mlir.register_lowering(prim, mlir.lower_fun(run, multiple_results=True))
    ad.primitive_jvps[prim] = lambda primals, tangents, **params: jax.jvp(
        lambda *a: run(*a, **params), tuple(primals),
        tuple(ad.instantiate_zeros(t) for t in tangents))
    return prim


def _run_body(*args, body, **_):
    return jax.core.eval_jaxpr(body.jaxpr, body.consts, *args)


# A higher-order primitive new to jaxmp (as xla_metadata_call is to jax 0.12): a matrix
# product inside its body.
_NEW_CALL = _primitive("test_new_call", _run_body)
# What a JAX release that renamed scan's parameters would bind: a primitive named "scan"
# whose body and trip count have names jaxmp does not know.
_RENAMED_SCAN = _primitive("scan", lambda *a, body, **_: _run_body(*a, body=body))


def _with_new_call(w, x):
    body = jax.make_jaxpr(lambda w, x: [jnp.tanh(x @ w)])(w, x)
    (h,) = _NEW_CALL.bind(w, x, body=body)
    return jnp.sum(h * h)


def _with_renamed_scan(w, x):
    body = jax.make_jaxpr(lambda w, x: [jnp.tanh(x @ w)])(w, x)
    (h,) = _RENAMED_SCAN.bind(w, x, body=body, trip_count=1)
    return jnp.sum(h * h)


@pytest.mark.parametrize("fn, primitive", [(_with_new_call, "test_new_call"),
                                           (_with_renamed_scan, "scan")])
def test_autocast_runs_an_equation_it_does_not_understand_as_written_and_says_once(fn, primitive):
    w, x = jnp.full((4, 4), 0.25), jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cast = jaxmp.autocast(fn, jnp.float16)
        out = cast(w, x)
        out_again = cast(w * 2.0, x)
        grads = jax.grad(jaxmp.autocast(fn, jnp.float16))(w, x)
        grads_again = jax.jit(jax.grad(jaxmp.autocast(fn, jnp.float16)))(w, x)
    said = [c for c in caught if issubclass(c.category, jaxmp.debug.UnknownEquationWarning)]
    assert len(said) == 1, [str(c.message) for c in caught]
    assert f"a {primitive} equation" in str(said[0].message)
    assert "runs as written" in str(said[0].message)
    # As written: in float32, exactly the function's own result.
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, fn(w, x), rtol=1e-6)
    np.testing.assert_allclose(out_again, fn(w * 2.0, x), rtol=1e-6)
    assert not np.allclose(out, out_again)
    for g in (grads, grads_again):
        np.testing.assert_allclose(g, jax.grad(fn)(w, x), rtol=1e-6)


def test_find_nonfinite_runs_an_equation_it_does_not_understand_as_written():
    w, x = jnp.full((4, 4), 0.25), jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    with pytest.warns(jaxmp.debug.UnknownEquationWarning, match="test_new_call"):
        report = jaxmp.debug.find_nonfinite(_with_new_call, compute_dtype=jnp.float16)(w, x)
    assert not report.findings
    # What the equation computes is not diagnosed, but what the function does around it is.
    with pytest.warns(jaxmp.debug.UnknownEquationWarning, match="test_new_call"):
        loss = lambda w, x: _with_new_call(w, x) + jnp.sum(jnp.exp(w * 60.0))
        report = jaxmp.debug.find_nonfinite(loss, compute_dtype=jnp.float16, autocast=False)(w, x)
    assert [f.primitive for f in report.findings][:1] == ["exp"], str(report)


def test_an_equation_with_parameters_jaxmp_does_not_know_runs_as_written_in_every_interpreter(
        monkeypatch):
    """A scan whose parameters changed (simulated: jaxmp's accessor finds none it knows)."""
    def original_scan(eqn):
        raise compat.UnknownEquation(eqn, "'num_consts' or 'ft_in'")

    monkeypatch.setattr(compat, "scan", original_scan)

    def f(w, x):
        return jnp.sum(jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=3)[0])

    w, x = jnp.full((4, 4), 0.25), jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    closed = jax.make_jaxpr(f)(w, x)
    with pytest.warns(jaxmp.debug.UnknownEquationWarning, match="a scan equation .*no parameter"):
        (out,) = interpret.Interpreter().eval_closed(closed, [w, x])
    np.testing.assert_allclose(out, f(w, x), rtol=1e-6)


def _eqn(fn, *args):
    return jax.make_jaxpr(fn)(*args).jaxpr.eqns[0]


def test_bind_params_rebinds_an_equation_to_the_same_result():
    eqn = _eqn(lambda x: jnp.sum(x, axis=1), jnp.ones((2, 3)))
    subfuns, params = compat.bind_params(eqn.primitive, eqn.params)
    assert isinstance(params, dict) and params["axes"] == (1,)
    x = jnp.arange(6.0).reshape(2, 3)
    out = eqn.primitive.bind(*subfuns, x, **params)
    np.testing.assert_array_equal(out, np.arange(6.0).reshape(2, 3).sum(1))


def test_bind_params_reads_both_forms_of_get_bind_params():
    class Old:  # jax <= 0.8
        def get_bind_params(self, params):
            return ["f"], params

    class New:
        def get_bind_params(self, params):
            return params

    assert compat.bind_params(Old(), {"a": 1}) == (["f"], {"a": 1})
    assert compat.bind_params(New(), {"a": 1}) == ([], {"a": 1})


def test_pcast_to_varying_types_a_value_as_varying_inside_shard_map():
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    seen = {}

    def body(x):
        replicated = jnp.zeros((), jnp.float32)
        seen["before"] = compat.varying_axes(replicated)
        seen["after"] = compat.varying_axes(compat.pcast_to_varying(replicated, ("data",)))
        seen["input"] = compat.varying_axes(x)
        return x

    jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(jnp.ones(8))
    assert seen == {"before": frozenset(), "after": frozenset({"data"}),
                    "input": frozenset({"data"})}
    assert compat.varying_axes(jnp.ones(3)) == frozenset()  # outside shard_map


@pytest.mark.parametrize("private", [True, False])
def test_user_frames_name_the_users_line(private):
    def f(x):
        return jnp.sin(x) * 2.0  # this line

    line = f.__code__.co_firstlineno + 1
    frames = compat.user_frames(_eqn(f, 1.0).source_info.traceback, private=private)
    assert frames, "no user frame"
    first = frames[0]
    assert (os.path.basename(first.file_name), first.function_name, first.start_line) == (
        "test_compat.py", f.__qualname__, line)
    jax_dir = os.path.dirname(jax.__file__)
    assert not any(os.path.abspath(fr.file_name).startswith(jax_dir) for fr in frames)
    assert compat.user_frames(None, private=private) == []


def test_find_nonfinite_names_the_line_without_the_private_api(monkeypatch):
    monkeypatch.setattr(compat, "_private_source_info", None)

    def loss(params, x):
        return jnp.sum(jnp.exp(x * params["w"]))  # overflows in float16

    report = jaxmp.debug.find_nonfinite(loss, autocast=False,
                                        compute_dtype=jnp.float16)(
                                            {"w": jnp.float32(30.0)}, jnp.ones(4))
    assert report.findings
    assert "test_compat.py" in str(report), str(report)


def test_no_host_callbacks_retraces_a_jitted_step_without_callbacks():
    calls = []

    @jax.jit
    def step(x):
        host.call_back_if(x > 0, lambda v: calls.append(float(v)), x)
        return x * 2

    step(jnp.float32(1.0)).block_until_ready()
    jax.effects_barrier()
    assert calls == [1.0]
    with host.no_host_callbacks():  # part of the trace cache key: traced again, without
        assert "callback" not in step.lower(jnp.float32(1.0)).as_text()
        step(jnp.float32(3.0)).block_until_ready()
    jax.effects_barrier()
    assert calls == [1.0]
    step(jnp.float32(2.0)).block_until_ready()  # and with them again outside
    jax.effects_barrier()
    assert calls == [1.0, 2.0]
