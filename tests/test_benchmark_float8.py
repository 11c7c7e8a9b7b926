"""Smoke test of benchmarks/float8.py: the quick configuration end to end."""

import json

import pytest

from benchmarks import float8 as bench


@pytest.mark.slow  # about three minutes on 2 busy CPU cores (compiles and trains two models 4 ways)
def test_quick_run_reports_float8_shares_memory_and_losses(tmp_path):
    # The ViT alone: the suite's time (the language model shares every code path).
    results = bench.main(["--out", str(tmp_path), "--quick", "--repeats", "1",
                          "--models", "vit_tiny"])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["static"].keys() == {"vit_tiny"}
    for rows in saved["static"].values():
        f8, bf16 = rows["float8"], rows["bfloat16"]
        assert f8["float8_share_forward"] >= 0.99 and f8["float8_share_backward"] >= 0.99
        assert bf16["float8_share_step"] == 0.0 and bf16["low_precision_share_step"] == 1.0
        # float8 residuals take one byte per element where bfloat16 takes two.
        assert f8["saved_activation_bytes"] < bf16["saved_activation_bytes"]
        assert f8["xla_total_bytes"] > 0 and f8["step_time_s"] > 0
        head = rows["float8_head_bf16"]  # the output projection in bfloat16, the rest float8
        assert 0.5 < head["float8_share_step"] < 1.0 and head["low_precision_share_step"] == 1.0
    assert results["training"].keys() == {"vit_tiny_digits"}
    for name, run in results["training"].items():
        assert run["nonfinite_losses"] == 0
        (seed,) = run["seeds"]
        assert seed["float8"]["final_train_loss"] < seed["float8"]["first_loss"]  # it trains
        assert abs(run["ratio_to_bfloat16"]["float8"] - 1) < 0.05, name
        assert abs(run["ratio_to_bfloat16"]["float32"] - 1) < 0.05, name
    assert "| vit_tiny | float8 |" in (tmp_path / "results.md").read_text()
