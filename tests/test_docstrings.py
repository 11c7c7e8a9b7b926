"""Every public name has a docstring example, and every example runs on its own.

pytest's ``--doctest-modules`` runs the examples inside their module, where a
bare ``init_scaler(...)`` works and the test configuration (strict promotion,
four CPU devices) applies. A user pastes them into a fresh interpreter. So
here they run in a separate Python process with JAX's default configuration,
each docstring in an empty namespace: an example that uses a name it did not
import itself (``init_scaler(...)`` instead of ``jaxmp.init_scaler(...)``)
fails with a ``NameError``.

The names come from ``__all__`` of ``jaxmp``, ``jaxmp.debug`` and
``jaxmp.experimental``, so a name added later is covered.
"""

import doctest
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import jaxmp

ROOT = Path(__file__).resolve().parents[1]

# Runs in the child process: reads [(test name, docstring), ...] as JSON on
# stdin, runs each docstring's examples in a namespace of its own, and prints
# {test name: failure report} as JSON (empty reports are left out).
_CHILD = r"""
import doctest, json, sys
import jaxmp  # loaded once, to save time; each example still has to import it itself

flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS  # as pytest's doctest_optionflags
failures = {}
for name, docstring in json.load(sys.stdin):
    test = doctest.DocTestParser().get_doctest(docstring, {"__name__": "__main__"}, name, None, 0)
    report = []
    runner = doctest.DocTestRunner(optionflags=flags)
    runner.run(test, out=report.append, clear_globs=True)
    if runner.failures:
        failures[name] = "".join(report)
print(json.dumps(failures))
"""


# Every public name, relative to jaxmp: ``mp_grad``, ``debug.find_nonfinite``, ...
PUBLIC = [*jaxmp.__all__, *(f"debug.{name}" for name in jaxmp.debug.__all__),
          *(f"experimental.{name}" for name in jaxmp.experimental.__all__)]


def _docstrings(name):
    """``(test name, docstring)`` of ``jaxmp.<name>`` and its methods, those with examples."""
    obj = jaxmp
    for part in name.split("."):
        obj = getattr(obj, part)
    finder = doctest.DocTestFinder(recurse=inspect.isclass(obj))
    tests = finder.find(obj, f"jaxmp.{name}", module=False, globs={})
    return [(t.name, t.docstring) for t in tests if t.examples]


def test_every_public_name_has_an_example():
    missing = [name for name in PUBLIC if not _docstrings(name)]
    assert not missing, f"no docstring example (a '>>>' line) for: {', '.join(missing)}"


def test_docstring_examples_run_in_a_fresh_interpreter():
    docstrings = [pair for name in sorted(PUBLIC) for pair in _docstrings(name)]
    assert docstrings
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(docstrings), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failures, "\n".join(f"--- {name}\n{report}" for name, report in failures.items())


def test_a_bare_name_fails_in_the_fresh_interpreter():
    """The check above can fail: an example written inside the module's namespace does here."""
    bare = ">>> float(init_scaler(initial_scale=4.0).scale)\n4.0\n"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps([["bare", bare]]),
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "NameError: name 'init_scaler' is not defined" in failures["bare"]
