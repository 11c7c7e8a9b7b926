"""The public API is what it claims to be, and the pinned names of issue 2 exist."""

import inspect

import jaxmp

PINNED = {
    "cast_tree", "cast_to_float16", "cast_to_bfloat16", "cast_to_float32", "cast_to_half_precision",
    "cast_function", "force_full_precision", "Policy", "get_policy", "init_scaler", "scale",
    "unscale", "adjust", "all_finite", "mp_value_and_grad", "mp_grad", "optimizer_update",
}


def test_all_is_exactly_the_public_names():
    public = {name for name in dir(jaxmp) if not name.startswith("_")}
    modules = {name for name in public if inspect.ismodule(getattr(jaxmp, name))}
    assert set(jaxmp.__all__) == public - modules
    assert len(jaxmp.__all__) == len(set(jaxmp.__all__))


def test_pinned_names_exist_and_are_documented():
    assert PINNED <= set(jaxmp.__all__)
    for name in jaxmp.__all__:
        assert getattr(jaxmp, name).__doc__, f"jaxmp.{name} has no docstring"


def test_scaler_state_is_keyword_only():
    import jax.numpy as jnp
    import pytest

    fn = jaxmp.mp_value_and_grad(lambda w: jnp.sum(w), compute_dtype=jnp.float16)
    with pytest.raises(TypeError, match="scaler_state"):
        fn(jnp.ones(2), jaxmp.init_scaler())


def test_the_api_index_lists_every_public_name_with_its_signature():
    """docs/api/index.md is generated from the code: every name of __all__, its real signature."""
    import importlib.util
    import pathlib
    import re

    path = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api" / "signatures.py"
    spec = importlib.util.spec_from_file_location("signatures", path)
    signatures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(signatures)
    page = (path.parent / "index.md").read_text()
    assert signatures.page_section(page) == signatures.render(), (
        "docs/api/index.md is out of date: run `python docs/api/signatures.py --write`")
    listed = re.findall(r"^(?:class )?jaxmp\.(\w+)\(", signatures.render(), flags=re.M)
    assert sorted(listed) == sorted(jaxmp.__all__)
    # The signatures are the code's, e.g. the keyword-only options and their defaults.
    assert "jaxmp.mp_value_and_grad(fn, *, argnums=0," in page
    assert "matmul_dtype=None,\n" in page and "compute_dtype=jnp.bfloat16" in page
