"""Every public name has a docstring example, and every example runs on its own.

A user pastes the examples into a fresh interpreter. So here they run in a
separate Python process with JAX's default configuration, each docstring in an
empty namespace: an example that uses a name it did not import itself
(``init_scaler(...)`` instead of ``jaxmp.init_scaler(...)``) fails with a
``NameError``. pytest's ``--doctest-modules`` runs the other examples (private
modules', module docstrings) in the test process; conftest.py leaves these out
of it, so that each example runs once.

The names come from ``__all__`` of ``jaxmp``, ``jaxmp.debug`` and
``jaxmp.experimental`` (``helpers.public_names``), so a name added later is covered.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import helpers

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


def test_every_public_name_has_an_example():
    missing = [name for name in helpers.public_names() if not helpers.examples_of(name)]
    assert not missing, f"no docstring example (a '>>>' line) for: {', '.join(missing)}"


# An example written inside the module's namespace: it must fail in the fresh interpreter.
BARE = ">>> float(init_scaler(initial_scale=4.0).scale)\n4.0\n"


def test_docstring_examples_run_in_a_fresh_interpreter():
    """Every public example passes there, and the check can fail: the bare one does.

    The bare example runs in the same process as the others (one interpreter started, not two).
    """
    docstrings = helpers.public_examples()
    assert docstrings
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _CHILD],
                          input=json.dumps([*docstrings, ["bare", BARE]]), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "NameError: name 'init_scaler' is not defined" in failures.pop("bare", "")
    assert not failures, "\n".join(f"--- {name}\n{report}" for name, report in failures.items())
