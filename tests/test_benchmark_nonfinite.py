"""benchmarks/nonfinite.py: what a diagnosis costs, on the quick configuration."""

import pytest

from benchmarks import nonfinite as bench


@pytest.mark.slow  # compiles a small ResNet18-shaped step and diagnoses it (about 20 s)
def test_quick_run_times_a_pmap_diagnosis_against_one_step():
    results = bench.main(["--quick", "--modes", "pmap", "--repeats", "1"])
    assert results["step_s"] > 0
    assert results["pmap_findings"] >= 1  # the injected overflow is found on the mapped step
    assert results["pmap_steps"] == results["pmap_s"] / results["step_s"] > 1
