"""The public API is what it claims to be, and the pinned names of issue 2 exist.

Issue 35: the top level holds what a training step needs; the tools that inspect a step are in
``jaxmp.debug``, the less mature features in ``jaxmp.experimental``. A name that moved is still
reachable at the top level for a release, with a ``DeprecationWarning`` naming its new home.
"""

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp._src import casting
from jaxmp._src import census
from jaxmp._src import compat
from jaxmp._src import diagnostics
from jaxmp._src import float8
from jaxmp._src import gpu_program
from jaxmp._src import low_precision
from jaxmp._src import nonfinite
from jaxmp._src import report
from jaxmp._src import shortfall

PINNED = {
    "cast_tree", "cast_function", "force_full_precision", "Policy", "get_policy", "init_scaler",
    "scale", "unscale", "adjust", "all_finite", "mp_value_and_grad", "mp_grad",
    "optimizer_update",
}
TOP_LEVEL = {
    "mp_value_and_grad", "mp_grad", "accumulate_value_and_grad", "autocast", "AutocastRules",
    "cast_tree", "cast_function", "force_full_precision", "ScalerState", "init_scaler",
    "static_scaler", "noop_scaler", "scaler_for", "scaler_metrics", "scale", "unscale",
    "all_finite", "adjust", "optimizer_update", "select_tree", "Policy", "get_policy",
    "SkippedStepsWarning", "TrainingStuckError", "TrainingStuckWarning",
}
# Each moved name: its new home, and the object it must be (defined in jaxmp._src).
MOVED = {
    "find_nonfinite": ("debug", nonfinite.find_nonfinite),
    "Finding": ("debug", nonfinite.Finding),
    "NonfiniteReport": ("debug", nonfinite.NonfiniteReport),
    "precision_report": ("debug", report.precision_report),
    "PrecisionReport": ("debug", report.PrecisionReport),
    "matmul_flops": ("debug", diagnostics.matmul_flops),
    "half_matmul_flop_share": ("debug", diagnostics.half_matmul_flop_share),
    "float8_matmul_flop_share": ("debug", diagnostics.float8_matmul_flop_share),
    "saved_activation_bytes": ("debug", diagnostics.saved_activation_bytes),
    "gpu_program": ("debug", gpu_program.gpu_program),
    "GpuProgram": ("debug", gpu_program.GpuProgram),
    "GpuTarget": ("debug", gpu_program.GpuTarget),
    "MostlyFloat32Warning": ("debug", census.MostlyFloat32Warning),
    "UnknownEquationWarning": ("debug", compat.UnknownEquationWarning),
    "is_float_array": ("debug", casting.is_float_array),
    "Float8Rules": ("experimental", float8.Float8Rules),
    "Float8ShortfallWarning": ("experimental", shortfall.Float8ShortfallWarning),
    "low_precision_optimizer": ("experimental", low_precision.low_precision_optimizer),
    "LowPrecisionState": ("experimental", low_precision.LowPrecisionState),
}
# Names that were never at the top level: the types a jaxmp.debug tool returns (issue 40).
DEBUG_ONLY = {
    "Kernel": gpu_program.Kernel,
    "Product": gpu_program.Product,
}
# Names new in jaxmp.experimental, never at the top level (issue 41: delayed float8
# scaling and placement; issue 42: NVFP4).
EXPERIMENTAL_ONLY = {
    "NVFP4": float8.NVFP4,
    "Float8State": jaxmp.experimental.Float8State,
    "init_float8_state": jaxmp.experimental.init_float8_state,
    "Float8PlacementWarning": shortfall.Float8PlacementWarning,
}
CAST_ALIASES = {
    "cast_to_float16": jnp.float16,
    "cast_to_bfloat16": jnp.bfloat16,
    "cast_to_float32": jnp.float32,
    "cast_to_half_precision": jnp.float16,
}
NAMESPACES = {"debug": jaxmp.debug, "experimental": jaxmp.experimental}


def _public_names():
    """Every public name, relative to jaxmp: ``mp_grad``, ``debug.find_nonfinite``, ..."""
    names = list(jaxmp.__all__)
    for prefix, module in NAMESPACES.items():
        names += [f"{prefix}.{name}" for name in module.__all__]
    return names


def test_all_is_exactly_the_public_names():
    public = {name for name in dir(jaxmp) if not name.startswith("_")}
    modules = {name for name in public if inspect.ismodule(getattr(jaxmp, name))}
    assert modules == set(NAMESPACES)
    assert set(jaxmp.__all__) == public - modules
    assert len(jaxmp.__all__) == len(set(jaxmp.__all__))
    for module in NAMESPACES.values():
        names = {name for name in dir(module) if not name.startswith("_")}
        assert set(module.__all__) == names
        assert len(module.__all__) == len(set(module.__all__))


def test_the_top_level_is_what_a_training_step_needs():
    assert len(jaxmp.__all__) <= 25
    assert set(jaxmp.__all__) == TOP_LEVEL


def test_the_namespaces_hold_the_moved_names_and_nothing_else():
    for prefix, module in NAMESPACES.items():
        only = set({"debug": DEBUG_ONLY, "experimental": EXPERIMENTAL_ONLY}[prefix])
        assert set(module.__all__) == {n for n, (home, _) in MOVED.items() if home == prefix} | only
    assert all(getattr(jaxmp.debug, name) is obj for name, obj in DEBUG_ONLY.items())
    assert all(getattr(jaxmp.experimental, n) is obj for n, obj in EXPERIMENTAL_ONLY.items())
    assert not (set(DEBUG_ONLY) | set(EXPERIMENTAL_ONLY)) & (set(jaxmp.__all__) | set(dir(jaxmp)))
    assert not set(MOVED) & set(jaxmp.__all__)
    assert not set(MOVED) & set(dir(jaxmp))  # reachable only through __getattr__
    assert not set(CAST_ALIASES) & (set(jaxmp.__all__) | set(dir(jaxmp)))


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_is_at_its_new_home(name):
    home, obj = MOVED[name]
    assert getattr(NAMESPACES[home], name) is obj


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_still_works_at_the_top_level_with_a_warning(name):
    home, obj = MOVED[name]
    message = rf"jaxmp\.{name} has moved to jaxmp\.{home}\.{name}"
    with pytest.warns(DeprecationWarning, match=message):
        assert getattr(jaxmp, name) is obj


def test_from_import_of_a_moved_name_warns_and_gives_the_same_object():
    with pytest.warns(DeprecationWarning, match=r"jaxmp\.debug\.find_nonfinite"):
        from jaxmp import find_nonfinite  # pylint: disable=g-import-not-at-top
    assert find_nonfinite is jaxmp.debug.find_nonfinite


def test_a_moved_warning_class_still_filters_at_the_top_level():
    """``warnings.simplefilter("error", jaxmp.MostlyFloat32Warning)`` in old code still works."""
    with pytest.warns(DeprecationWarning):
        category = jaxmp.MostlyFloat32Warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", category)
        with pytest.raises(jaxmp.debug.MostlyFloat32Warning):
            warnings.warn("mostly float32", census.MostlyFloat32Warning)


@pytest.mark.parametrize("name", sorted(CAST_ALIASES))
def test_a_cast_alias_warns_and_equals_cast_tree(name):
    dtype = CAST_ALIASES[name]
    tree = {"w": jnp.linspace(-3.0, 3.0, 7), "step": jnp.array(3), "key": jax.random.key(0)}
    use = rf"jaxmp\.cast_tree\(tree, jnp\.{jnp.dtype(dtype).name}\)"
    message = rf"jaxmp\.{name} is deprecated.*{use}"
    with pytest.warns(DeprecationWarning, match=message):
        out = getattr(jaxmp, name)(tree)
    expected = jaxmp.cast_tree(tree, dtype)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(expected)
    assert out["w"].dtype == dtype and out["step"].dtype == jnp.int32
    np.testing.assert_array_equal(out["w"], expected["w"])
    assert out["key"] is tree["key"]


def test_cast_to_half_precision_keeps_its_checks():
    with pytest.warns(DeprecationWarning, match=r"jaxmp\.cast_tree"):
        cast = jaxmp.cast_to_half_precision
    assert cast(jnp.ones(2), jnp.bfloat16).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="float16, bfloat16"):
        cast(jnp.ones(2), jnp.float32)
    with pytest.raises(ValueError, match="wrong order"):
        cast(jnp.float16, {"w": jnp.ones(2)})


def test_an_unknown_name_raises_attribute_error():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and says nothing else
        with pytest.raises(AttributeError, match="module 'jaxmp' has no attribute 'not_a_name'"):
            jaxmp.not_a_name  # noqa: B018
        assert not hasattr(jaxmp, "cast_to_float64")
        with pytest.raises(ImportError):
            from jaxmp import not_a_name  # noqa: F401  # pylint: disable=g-import-not-at-top


def test_pinned_names_exist_and_are_documented():
    assert PINNED <= set(jaxmp.__all__)
    for name in _public_names():
        obj = jaxmp
        for part in name.split("."):
            obj = getattr(obj, part)
        assert obj.__doc__, f"jaxmp.{name} has no docstring"
    for module in NAMESPACES.values():
        assert module.__doc__


def test_scaler_state_is_keyword_only():
    fn = jaxmp.mp_value_and_grad(lambda w: jnp.sum(w), compute_dtype=jnp.float16)
    with pytest.raises(TypeError, match="scaler_state"):
        fn(jnp.ones(2), jaxmp.init_scaler())


def test_the_api_index_lists_every_public_name_with_its_signature():
    """docs/api/index.md is generated from the code: every public name, its real signature."""
    import importlib.util  # pylint: disable=g-import-not-at-top
    import pathlib  # pylint: disable=g-import-not-at-top
    import re  # pylint: disable=g-import-not-at-top

    path = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api" / "signatures.py"
    spec = importlib.util.spec_from_file_location("signatures", path)
    signatures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(signatures)
    page = (path.parent / "index.md").read_text()
    assert signatures.page_section(page) == signatures.render(), (
        "docs/api/index.md is out of date: run `python docs/api/signatures.py --write`")
    listed = re.findall(r"^(?:class )?jaxmp\.([\w.]+)\(", signatures.render(), flags=re.M)
    assert sorted(listed) == sorted(_public_names())
    # The signatures are the code's, e.g. the keyword-only options and their defaults.
    assert "jaxmp.mp_value_and_grad(fn, *, argnums=0," in page
    assert "matmul_dtype=None,\n" in page and "compute_dtype=jnp.bfloat16" in page
    assert "jaxmp.debug.find_nonfinite(loss_fn," in page
    assert "class jaxmp.experimental.Float8ShortfallWarning(UserWarning)" in page
