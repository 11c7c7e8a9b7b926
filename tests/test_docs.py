"""The Python code of README.md and of the documentation pages runs as written.

Each page's blocks run in order, as one script, in a fresh namespace. A page
whose text says it continues another page (most continue the training step of
docs/getting_started.md) runs after that page's blocks, as a reader would run
them (from a copy of that page's namespace, which runs once per process). The
pages run in this process: conftest.py gives it the 4 CPU devices that
docs/multi_device.md needs.
"""

import functools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TEST_COMMAND = 'pip install -e ".[test]" && pytest -n auto'
SLOW_COMMAND = "pytest -n auto -m slow"
GPU_PROGRAM_COMMAND = 'pip install -e ".[gpu-compile]" && JAX_PLATFORMS=cpu pytest -n auto -m gpu_program'
DOCS_COMMAND = 'pip install -e ".[docs]" && sphinx-build -W --keep-going -b html docs docs/_build/html'

# page -> the pages whose code it continues (run first, in this order).
PAGES = {
    "getting_started.md": [],
    "migration.md": ["getting_started.md"],
    "autocast.md": [],
    "float16_stuck.md": ["autocast.md"],
    "scaler.md": ["getting_started.md"],
    "framework_state.md": ["getting_started.md"],
    "accumulation.md": ["getting_started.md"],
    "checkpoint.md": ["getting_started.md"],
    "multi_device.md": ["getting_started.md"],
    "half_precision_check.md": [],
    "low_precision.md": ["getting_started.md"],
    "float8.md": ["getting_started.md"],
    "one_jit.md": [],
    "inference.md": ["getting_started.md"],
    "nnx.md": [],
    "index.md": [],
}
# Pages whose code a test file of their own runs and checks, as user code (under
# standard promotion), rather than these tests: page -> that file.
RUN_BY = {"recipes.md": "test_recipes.py", "precision_report.md": "test_report.py",
          "gpu_program.md": "test_gpu_program.py"}
# Pages whose code ends with a gradient step that returned `finite`.
# Pages that train bfloat16 parameters, with no float32 copy.
BFLOAT16_PARAMS = {"low_precision.md"}
ENDS_WITH_A_STEP = {"float8.md", "framework_state.md", "accumulation.md", "autocast.md", "float16_stuck.md"}


def _blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def _run(paths, namespace=None):
    namespace = {} if namespace is None else namespace
    for path in paths:
        for index, block in enumerate(_blocks(path)):
            name = f"{path.relative_to(ROOT)}[python block {index}]"
            exec(compile(block, name, "exec"), namespace)
    return namespace


@functools.cache
def _continued(pages):
    """The namespace of ``pages`` run in order, once per process.

    Most pages continue docs/getting_started.md: each starts from a copy of its namespace (its
    names stay the page's own) instead of running it again, and so calls the training step
    that it compiled once.
    """
    return _run([DOCS / p for p in pages])


# Pages whose Python blocks are not a program: the API index's signatures (tests/test_api.py
# checks them against the code).
NOT_PROGRAMS = {"api/index.md"}


def test_every_page_with_python_code_is_run():
    with_code = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if _blocks(p)} - NOT_PROGRAMS
    assert with_code == set(PAGES) | set(RUN_BY)
    for page, test_file in RUN_BY.items():
        assert page not in PAGES
        assert f'"{page}"' in (ROOT / "tests" / test_file).read_text(), (page, test_file)


def test_readme_python_blocks_run_in_order():
    blocks = _blocks(ROOT / "README.md")
    assert blocks
    namespace = _run([ROOT / "README.md"])
    # The training step really trained in mixed precision: float32 parameters,
    # a finite float32 loss.
    assert namespace["params"]["w1"].dtype == "float32"
    assert namespace["loss"].dtype == "float32" and bool(namespace["jnp"].isfinite(namespace["loss"]))


# The pages whose recipes compile a step per framework or recipe (15-20 s each) run with
# the end-to-end runs (slow): CI runs them after the default run.
SLOW_PAGES = {"float8.md", "low_precision.md"}


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_PAGES
                                  else p for p in sorted(PAGES)])
def test_page_python_blocks_run_in_order(page):
    prerequisites = PAGES[page]
    for earlier in prerequisites:  # the page says which page it continues
        assert f"]({earlier}" in (DOCS / page).read_text(), (page, earlier)
    namespace = _run([DOCS / page], dict(_continued(tuple(prerequisites))))
    if "params" in namespace:  # float32 master weights, but where the page keeps none
        expected = "bfloat16" if page in BFLOAT16_PARAMS else "float32"
        assert namespace["params"]["w1"].dtype == expected
    if page in ENDS_WITH_A_STEP:
        assert bool(namespace["finite"])


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert TEST_COMMAND in readme and TEST_COMMAND in ci
    assert TEST_COMMAND in (DOCS / "development.md").read_text()


def test_the_end_to_end_runs_are_left_out_by_default_and_ci_runs_them():
    """The default run leaves out the tests marked slow (the suite's time); CI runs them after
    it, as README and the development page say."""
    import tomllib

    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "-m 'not slow and not gpu_program'" in addopts["addopts"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index(TEST_COMMAND) < ci.index(SLOW_COMMAND)
    assert SLOW_COMMAND in (ROOT / "README.md").read_text()
    assert SLOW_COMMAND in (DOCS / "development.md").read_text()


def test_ci_runs_the_gpu_program_tests_with_the_cuda_plugin():
    """The gpu_program tests (left out by default: they need JAX's CUDA plugin) run in CI in
    the newest environment, after the plugin is installed, as the development page says."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert GPU_PROGRAM_COMMAND in ci and GPU_PROGRAM_COMMAND in (DOCS / "development.md").read_text()
    assert ci.index(SLOW_COMMAND) < ci.index(GPU_PROGRAM_COMMAND) < ci.index("deactivate")


def test_readme_docs_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert DOCS_COMMAND in readme and DOCS_COMMAND in ci
    assert DOCS_COMMAND in (DOCS / "development.md").read_text()


def test_readme_links_point_to_files_that_exist():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    assert len(links) >= 10
    for link in links:
        assert (ROOT / link).is_file(), link


def test_api_reference_documents_every_public_name():
    """Each name at its home: ``jaxmp.mp_grad``, ``jaxmp.debug.find_nonfinite``, ..."""
    import jaxmp

    documented = set()
    for page in (DOCS / "api").glob("*.md"):
        documented |= set(re.findall(r"\.\. auto(?:function|class|exception):: (jaxmp\.[\w.]+)",
                                     page.read_text()))
    public = {f"jaxmp.{name}" for name in jaxmp.__all__}
    for module in (jaxmp.debug, jaxmp.experimental):
        public |= {f"{module.__name__}.{name}" for name in module.__all__}
    assert documented == public
