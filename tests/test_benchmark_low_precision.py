"""The low-precision benchmark: its byte accounting, and a quick run of the script."""

import json
import os
import subprocess
import sys

import jax
import pytest

import jaxmp
from benchmarks import low_precision as bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_persistent_state_is_12_6_and_8_bytes_per_parameter():
    task = bench.vit_task(steps=2, quick=True, lr=1e-3)
    n = sum(x.size for x in jax.tree_util.tree_leaves(task.params))
    expected = {"float32": 12, "bf16_optax": 6, "nearest": 6, "stochastic": 6, "kahan": 8}
    for variant, per_param in expected.items():
        params, tx = bench.optimizer_for(variant, task)
        state = (params, tx.init(params), jaxmp.noop_scaler())
        fixed = bench.fixed_bytes(state)
        assert bench.tree_bytes(state) - fixed == per_param * n, variant
        # Besides the scaler's fields (its scalars and its record), a count and a key at most.
        scaler = bench.tree_bytes(jaxmp.noop_scaler())
        assert fixed - scaler <= 16, (variant, fixed, scaler)


@pytest.mark.slow
def test_quick_run_writes_every_figure(tmp_path):
    out = subprocess.run(
        # One model: the suite's time (the transformer task shares every code path).
        [sys.executable, "-m", "benchmarks.low_precision", "--out", str(tmp_path), "--quick",
         "--models", "vit"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [t["name"] for t in results["tasks"]] == ["vit"]
    for task in results["tasks"]:
        assert [r["variant"] for r in task["rows"]] == list(bench.VARIANTS)
        for row in task["rows"]:
            for key in ("bytes_per_param_excluding_fixed", "xla_total_bytes", "final_loss",
                        "final_loss_vs_float32", "update_ms", "update_time_vs_bf16_optax"):
                assert row[key] > 0, (row["variant"], key)
            assert row["finite"]
    table = (tmp_path / "results.md").read_text()
    assert "| stochastic | 6.00 |" in table and "| kahan | 8.00 |" in table
    assert "Command: `python -m benchmarks.low_precision" in table
