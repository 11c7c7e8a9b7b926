"""Every feature on every framework: the matrix of ``benchmarks/frameworks.py`` (issue 24).

Each cell trains a tiny model, written as the framework's users write it, for a few steps with
one jaxmp feature and checks what the feature promises: the share of the whole step's matrix
and convolution FLOPs in the requested dtype, the loss near the float32 run's, the bytes per
parameter of half-byte state, an injected overflow found at its line, the FLOP tools on the
step as written. The models and the targets live in the benchmark, which prints the same
matrix with its figures (``python -m benchmarks.frameworks --out DIR``).
"""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import frameworks

# Column by column, so that a process reuses the column's float32 run and compiled steps.
CELLS = [(feature, framework)
         for framework in frameworks.FRAMEWORKS for feature in frameworks.FEATURES]
# The default run: every feature once and every framework once (a diagonal through the matrix,
# wrapping round); the whole matrix runs with the slow tests (-m slow).
_WIDTH = max(len(frameworks.FEATURES), len(frameworks.FRAMEWORKS))
COVER = {(frameworks.FEATURES[i % len(frameworks.FEATURES)],
          frameworks.FRAMEWORKS[i % len(frameworks.FRAMEWORKS)]) for i in range(_WIDTH)}


@pytest.mark.parametrize("feature,framework", [
    pytest.param(f, fw, id=f"{f}-{fw}", marks=() if (f, fw) in COVER else pytest.mark.slow)
    for f, fw in CELLS])
def test_every_feature_on_every_framework(feature, framework):
    result = frameworks.run_cell(feature, framework)
    assert "error" not in result, f"{result['error']}\n{result['traceback']}"
    target = frameworks.target_of(feature, framework)
    if target is not None:
        assert result["share"] >= target.min_share, (
            f"{result['share']:.2%} of the matmul FLOPs in {target.dtype}: {result['flops']}")
        assert result["gap"] <= target.max_gap, (
            f"loss {result['loss']:.5f}, float32 {result['reference_loss']:.5f}")
        if target.max_bytes_per_param is not None:
            assert result["bytes_per_param"] <= frameworks.max_bytes_per_param(feature, framework)
    if feature == "find_nonfinite":
        assert result["found"].startswith("forward ") and "frameworks.py:" in result["found"]
    assert result["status"] == "pass", "; ".join(result["failures"])


def test_a_cell_that_misses_its_target_fails(monkeypatch):
    # The checks can fail: the same bfloat16 run judged against targets it cannot meet.
    monkeypatch.setitem(frameworks.TARGETS, "bfloat16",
                        frameworks.Target("float16", 1.0, 0.0, max_bytes_per_param=1.0))
    result = frameworks.run_cell("bfloat16", "multisteps")
    assert result["status"] == "fail" and result["share"] == 0.0
    assert [f.split()[0] for f in result["failures"]] == ["float16", "loss", "16.00"]


def test_find_nonfinite_cell_fails_when_nothing_overflows(monkeypatch):
    s = frameworks.setup("multisteps", "float16")
    monkeypatch.setattr(frameworks, "setup", lambda *_: s._replace(inject=lambda c, b: (c, b)))
    result = frameworks.run_cell("find_nonfinite", "multisteps")
    assert result["status"] == "fail" and "not found" in result["failures"][0]


def test_an_unsupported_combination_must_raise_while_tracing(monkeypatch):
    monkeypatch.setitem(frameworks.UNSUPPORTED, ("bfloat16", "multisteps"), (TypeError, "never"))
    result = frameworks.run_cell("bfloat16", "multisteps")  # it traces fine: that is a failure
    assert result["status"] == "fail" and "no TypeError while tracing" in result["failures"][0]


def test_share_of_counts_only_the_requested_dtype():
    totals = {"float16": 6, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e4m3fn+float8_e5m2": 1,
              "float32": 0}
    assert frameworks.share_of(totals, "float16") == 0.6
    assert frameworks.share_of(totals, "float8") == 0.2
    assert frameworks.share_of({}, "float16") == 0.0


def test_the_default_run_covers_every_feature_and_every_framework():
    assert {f for f, _ in COVER} == set(frameworks.FEATURES)
    assert {fw for _, fw in COVER} == set(frameworks.FRAMEWORKS)


def test_the_table_has_a_row_per_feature_and_a_column_per_framework():
    results = [{"feature": f, "framework": fw, "status": "pass", "share": 1.0, "gap": 0.001}
               for f in ("float16", "bfloat16") for fw in frameworks.FRAMEWORKS]
    results[0] = dict(results[0], status="fail", error="TypeError: x")
    table = frameworks.markdown(results).splitlines()
    assert len(table) == 2 + len(frameworks.FEATURES)
    assert table[0].count("|") == len(frameworks.FRAMEWORKS) + 2
    assert "**FAIL** TypeError: x" in table[2] and table[3].count("100% / 0.10%") == 6


def test_the_models_are_tiny():
    # The matrix stays fast because every model is: a guard against a model growing.
    for framework in frameworks.FRAMEWORKS:
        params, _ = frameworks.setup(framework, "float32").persistent(
            frameworks.setup(framework, "float32").state)
        count = sum(x.size for x in jax.tree_util.tree_leaves(params)
                    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating))
        assert count < 20_000, (framework, count)
