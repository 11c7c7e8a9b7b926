"""Declared bounds are tested bounds.

Every lower bound in pyproject.toml of a library jaxmp or its tests build on is
pinned, exactly, in constraints/oldest.txt, from which .ci/run installs the
oldest environment and runs the tests there too.
"""

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The libraries whose oldest supported version is tested (the rest of the test
# extra, pytest, scikit-learn, matplotlib..., is tooling and data).
TESTED = {"jax", "jaxlib", "flax", "optax", "numpy", "dm-haiku", "equinox", "orbax-checkpoint"}


def _lower_bounds():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    bounds = {}
    for requirement in requirements:
        found = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?\s*(?:>=\s*([^,;\s]+))?(.*)",
                             requirement)
        name, extras, version, rest = (found.group(1).lower(), found.group(2), found.group(3),
                                       found.group(4).strip())
        if extras and not version and not rest:
            continue  # jax[cuda13-local]: a component of a bounded library, not a bound
        if name in TESTED:
            assert name not in bounds, f"{name} is bounded twice in pyproject.toml"
            bounds[name] = version
    return bounds


def _pins():
    pins = {}
    for line in (ROOT / "constraints" / "oldest.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def test_requires_python_is_what_the_oldest_jax_needs():
    # jax 0.8 and flax 0.12 need Python 3.11; CI runs the oldest versions on 3.11.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"


def test_the_pythons_ci_tests_are_the_classifiers_and_the_docs_say_so():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    classified = {c.rsplit(" :: ", 1)[1] for c in project["classifiers"]
                  if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)}
    assert classified == {"3.11", "3.13"}  # the oldest versions' Python and the newest's
    ci = (ROOT / ".ci" / "run").read_text()
    development = (ROOT / "docs" / "development.md").read_text()
    for version in classified:
        assert f"find_python {version} " in ci, version
        assert f"Python {version}" in development, version


def test_every_tested_library_has_a_lower_bound():
    assert set(_lower_bounds()) == TESTED
    assert all(_lower_bounds().values())


def test_oldest_constraints_pin_exactly_the_lower_bounds():
    assert _pins() == _lower_bounds()


def test_ci_runs_the_tests_on_the_oldest_versions_as_the_docs_say():
    command = 'pip install -e ".[test]" -c constraints/oldest.txt && pytest -n auto'
    assert command in (ROOT / ".ci" / "run").read_text()
    assert command in (ROOT / "docs" / "development.md").read_text()
