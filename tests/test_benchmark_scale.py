"""The scale benchmark (benchmarks/scale.py): a quick run measures every variant it runs."""

import json
import subprocess
import sys

import pytest

from benchmarks import scale

ROOT = __file__.rsplit("/tests/", 1)[0]


@pytest.mark.slow
def test_quick_run_measures_each_variant_at_two_depths(tmp_path):
    variants = ["hand_dyn", "autocast", "float8"]
    subprocess.run([sys.executable, "-m", "benchmarks.scale", "--quick", "--layouts", "unrolled",
                    "--variants", ",".join(variants), "--out", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True, text=True, timeout=900)
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    runs = results["runs"]
    for depth in (1, 2):
        for name in variants:
            ok = [r for r in runs[f"unrolled/{depth}/{name}"] if "error" not in r]
            assert ok, runs[f"unrolled/{depth}/{name}"]
            assert ok[0]["trace_s"] > 0 and ok[0]["compile_s"] > 0 and ok[0]["hlo_ops"] > 0
    # A second layer adds instructions to every program.
    for name in variants:
        one, two = (runs[f"unrolled/{d}/{name}"][0]["hlo_ops"] for d in (1, 2))
        assert two > one, name
    assert scale.exponent({k: v[0] for k, v in runs.items()}, "unrolled", "autocast",
                          "hlo_ops", 1, 2) > 0
