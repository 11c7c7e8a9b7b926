"""Our `examples` package, and the one dm-haiku installs.

dm-haiku's wheel puts a top-level `examples` directory (imagenet, impala, rnn,
transformer) into site-packages, with no `__init__.py`: a namespace package.
Ours has an `__init__.py`, a regular package, which Python's import system
takes wherever it is on sys.path, before any namespace portion. So
`python -m examples.haiku.train` from the repository root (or anywhere with an
editable install, which puts the root on sys.path) gets ours, even when
Haiku's directory comes first. Outside the repository with jaxmp installed
without -e, only Haiku's can be found ("No module named 'examples.haiku'"):
docs/examples/index.md says to run the examples from the root.
"""

import importlib.metadata
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _haikus_examples_parent():
    """The directory that holds dm-haiku's top-level `examples` (site-packages), if it has one."""
    try:
        files = importlib.metadata.files("dm-haiku") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("dm-haiku is not installed")
    for f in files:
        if f.parts[0] == "examples":
            return pathlib.Path(f.locate()).parents[len(f.parts) - 1]
    pytest.skip("this dm-haiku installs no top-level examples package")


def test_ours_is_a_regular_package():
    assert (ROOT / "examples" / "__init__.py").is_file()
    assert (ROOT / "examples" / "haiku" / "__init__.py").is_file()


def test_haikus_examples_is_a_namespace_package():
    # If a dm-haiku release gave it an __init__.py, the order of sys.path would
    # decide which `examples` wins, and this file's reasoning would no longer hold.
    parent = _haikus_examples_parent()
    assert (parent / "examples").is_dir()
    assert not (parent / "examples" / "__init__.py").exists()


def test_ours_wins_when_haikus_comes_first_on_sys_path():
    parent = _haikus_examples_parent()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(parent), str(ROOT)])}
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import examples.haiku.train as t; "
            "print(t.__file__)")
    proc = subprocess.run([sys.executable, "-c", code, str(parent)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert pathlib.Path(proc.stdout.strip()) == ROOT / "examples" / "haiku" / "train.py"


def test_module_command_runs_ours_with_haikus_first_on_the_path():
    parent = _haikus_examples_parent()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(parent), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "examples.haiku.train", "--help"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--precision" in proc.stdout
