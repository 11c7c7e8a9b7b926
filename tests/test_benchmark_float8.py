"""Smoke test of benchmarks/float8.py: the quick configuration end to end."""

import json

import jax.numpy as jnp
import pytest

import jaxmp
from benchmarks import float8 as bench
from jaxmp._src.float8.rules import Product


@pytest.mark.slow  # about three minutes on 2 busy CPU cores (compiles and trains two models 4 ways)
def test_quick_run_reports_float8_shares_memory_and_losses(tmp_path):
    # The ViT alone: the suite's time (the language model shares every code path).
    results = bench.main(["--out", str(tmp_path), "--quick", "--repeats", "1",
                          "--models", "vit_tiny"])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["static"].keys() == {"vit_tiny"}
    for rows in saved["static"].values():
        f8, bf16 = rows["float8"], rows["bfloat16"]
        # Every product but the attention's q @ k.T and probs @ v, kept in bfloat16 by default
        # (float8 does not pay for them); bfloat16 + float8: everything.
        assert 0.7 < f8["float8_share_forward"] < 1 and 0.7 < f8["float8_share_backward"] < 1
        assert f8["low_precision_share_step"] == 1.0
        assert bf16["float8_share_step"] == 0.0 and bf16["low_precision_share_step"] == 1.0
        # float8 residuals take one byte per element where bfloat16 takes two.
        assert f8["saved_activation_bytes"] < bf16["saved_activation_bytes"]
        assert f8["xla_total_bytes"] > 0 and f8["step_time_s"] > 0
        head = rows["float8_head_bf16"]  # the output projection in bfloat16, the rest float8
        assert 0.5 < head["float8_share_step"] < 1.0 and head["low_precision_share_step"] == 1.0
        mx = rows["mxfp8"]  # counted in the CUDA program: cuDNN's block-scaled dot
        assert mx["flops_platform"] == "cuda" == f8["flops_platform"]
        assert 0.7 < mx["float8_share_forward"] < 1 and 0.7 < mx["float8_share_backward"] < 1
        # One byte per element and one scale byte per 32.
        assert mx["saved_activation_bytes"] < bf16["saved_activation_bytes"]
    assert results["training"].keys() == {"vit_tiny_digits"}
    for name, run in results["training"].items():
        assert run["nonfinite_losses"] == 0
        (seed,) = run["seeds"]
        assert seed["float8"]["final_train_loss"] < seed["float8"]["first_loss"]  # it trains
        assert abs(run["ratio_to_bfloat16"]["float8"] - 1) < 0.05, name
        assert abs(run["ratio_to_bfloat16"]["mxfp8"] - 1) < 0.05, name
        assert abs(run["ratio_to_bfloat16"]["float32"] - 1) < 0.05, name
    assert results["outlier_rows"]["worst_row_ratio_float8_to_mxfp8"] > 4
    text = (tmp_path / "results.md").read_text()
    assert "| vit_tiny | float8 |" in text and "| vit_tiny | mxfp8 |" in text
    assert "| mxfp8 |" in text  # the outlier-rows table


def test_outlier_rows_mxfp8_keeps_every_row_per_tensor_float8_does_not():
    out = bench.outlier_rows(rows=64, depth=64, outputs=32, large=2)
    assert out["mxfp8"]["worst_row"] < 0.1 and out["bfloat16"]["worst_row"] < 0.01
    assert out["float8"]["median_row"] > 0.3  # the small rows lose most of their digits
    assert out["worst_row_ratio_float8_to_mxfp8"] > 4  # the target of the benchmark


def test_variants_option_selects_and_checks_variants():
    args = bench.parse_args(["--out", "x", "--variants", "mxfp8,float8"])
    assert args.variants == ["bfloat16", "float8", "mxfp8"]  # bfloat16: the reference
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x", "--variants", "mxfp4"])


def test_nvfp4_variants_turn_one_switch_off_each():
    model = bench.Model("m", None, None, (), None, outputs=10)
    on = bench.float8_scaling("nvfp4", model)
    assert isinstance(on, jaxmp.experimental.NVFP4)
    assert on.weight_blocks_2d and on.hadamard and on.stochastic_rounding
    # The model's output projection (width 10) and attention's batched products are kept.
    product = lambda rhs, batched=False: Product("dot_general", (4, 8), rhs, 64, "", batched)
    assert on.keep.keeps(product((8, 10))) and on.keep.keeps(product((4, 8, 8), True))
    assert not on.keep.keeps(product((8, 12)))
    off = {v: bench.float8_scaling(v, model) for v in bench.NVFP4_SWITCHES if v != "nvfp4"}
    assert not off["nvfp4_1d_weights"].weight_blocks_2d and not off["nvfp4_no_hadamard"].hadamard
    assert not off["nvfp4_nearest"].stochastic_rounding
    assert off["nvfp4_keep_none"].keep == jaxmp.experimental.Float8Rules()
    for variant, options in off.items():  # every other switch as nvfp4 has it
        differ = [f for f in ("weight_blocks_2d", "hadamard", "stochastic_rounding")
                  if getattr(options, f) != getattr(on, f)]
        keeps_head = options.keep.keeps(product((8, 10)))
        assert len(differ) + (not keeps_head) == 1, (variant, differ)
    assert bench.float8_options(model, "nvfp4_nearest") == (jnp.float4_e2m1fn, None)


@pytest.mark.slow  # about 40 s on 2 busy cores: compiles the smallest LM's step three ways
def test_nvfp4_rows_train_the_smallest_language_model(tmp_path):
    results = bench.main(["--out", str(tmp_path), "--quick", "--models", "transformer_lm",
                          "--no-static", "--no-float32", "--lm-steps", "4",
                          "--variants", "nvfp4,nvfp4_keep_none"])
    run = results["training"]["transformer_lm"]
    assert set(run["mean_final_train_loss"]) == {"bfloat16", "nvfp4", "nvfp4_keep_none"}
    assert run["nonfinite_losses"] == 0
    assert abs(run["ratio_to_bfloat16"]["nvfp4"] - 1) < 0.05
    (seed,) = run["seeds"]  # keeping the head and attention changes the numbers
    assert seed["nvfp4"]["final_train_loss"] != seed["nvfp4_keep_none"]["final_train_loss"]
    assert "| transformer_lm | 4 x 1 | nvfp4_keep_none |" in (tmp_path / "results.md").read_text()
