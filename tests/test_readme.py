"""The Python examples in README.md run as written, in order, as one script."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_blocks_run_in_order():
    assert len(BLOCKS) >= 3
    namespace = {}
    for index, block in enumerate(BLOCKS):
        exec(compile(block, f"README.md[python block {index}]", "exec"), namespace)
    # The training step of the first block really trained in mixed precision.
    assert namespace["params"]["w1"].dtype == "float32"
    assert bool(namespace["finite"])


def test_readme_test_command_is_what_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    command = 'pip install -e ".[test]" && pytest -n auto'
    assert command in README.read_text() and command in ci
