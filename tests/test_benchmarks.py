"""Tests of the benchmark suite: the ViT model, the hand-written step, and a quick run."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from benchmarks import models
from benchmarks import vit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = models.TINY_VIT


def _batch(batch_size=4):
    return vit.random_batch(jax.random.key(1), CONFIG, batch_size)


def test_vit_shapes_and_float32_params():
    params = models.init_vit(jax.random.key(0), CONFIG)
    images, labels = _batch(4)
    logits = jax.jit(models.vit_apply, static_argnums=2)(params, images, CONFIG)
    assert logits.shape == (4, CONFIG.num_classes)
    assert logits.dtype == jnp.float32
    assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.float32)}
    assert len(params["blocks"]) == CONFIG.depth
    assert params["pos"].shape == (1, CONFIG.num_patches + 1, CONFIG.width)
    loss = jax.jit(models.vit_loss, static_argnums=3)(params, images, labels, CONFIG)
    assert loss.shape == () and bool(jnp.isfinite(loss))
    # A freshly initialised classifier is close to uniform: loss near log(classes).
    assert abs(float(loss) - math.log(CONFIG.num_classes)) < 1.5


def test_vit_loss_matches_reference_cross_entropy():
    params = models.init_vit(jax.random.key(0), CONFIG)
    images, labels = _batch(4)
    logits = np.asarray(models.vit_apply(params, images, CONFIG), np.float64)
    log_probs = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    expected = -np.mean(log_probs[np.arange(4), np.asarray(labels)])
    np.testing.assert_allclose(float(models.vit_loss(params, images, labels, CONFIG)), expected, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_vit_runs_in_half_precision_under_strict_promotion(dtype):
    params = models.init_vit(jax.random.key(0), CONFIG)
    images, labels = _batch(4)
    half_params = jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
    with jax.numpy_dtype_promotion("strict"):  # jit traces here, so strict applies to every op
        logits = jax.jit(models.vit_apply, static_argnums=2)(half_params, images.astype(dtype), CONFIG)
        loss, grads = jax.jit(jax.value_and_grad(models.vit_loss), static_argnums=3)(
            half_params, images.astype(dtype), labels, CONFIG
        )
    assert logits.dtype == dtype and loss.dtype == dtype
    assert {g.dtype for g in jax.tree_util.tree_leaves(grads)} == {jnp.dtype(dtype)}
    reference = jax.jit(models.vit_loss, static_argnums=3)(params, images, labels, CONFIG)
    np.testing.assert_allclose(float(loss), float(reference), rtol=3e-2)
    reference_logits = jax.jit(models.vit_apply, static_argnums=2)(params, images, CONFIG)
    np.testing.assert_allclose(np.asarray(logits, np.float32), np.asarray(reference_logits), atol=0.1)


def test_hand_written_and_jaxmp_steps_give_the_same_gradients():
    params = models.init_vit(jax.random.key(0), CONFIG)
    images, labels = _batch(8)
    hand = vit.make_variant("hand_written", CONFIG, initial_scale=128.0)
    ours = vit.make_variant("jaxmp", CONFIG, initial_scale=128.0)

    def grads_and_step(variant):
        # One compilation for both (XLA shares the gradient computation).
        both = jax.jit(lambda s, x, y: (variant.grads(s, x, y), variant.step(s, x, y)))
        return both(variant.init(params), images, labels)

    g_hand, (s_hand, loss_hand) = grads_and_step(hand)
    g_ours, (s_ours, loss_ours) = grads_and_step(ours)
    g_f32 = jax.jit(jax.grad(models.vit_loss), static_argnums=3)(params, images, labels, CONFIG)
    for a, b, ref in zip(*(jax.tree_util.tree_leaves(t) for t in (g_hand, g_ours, g_f32))):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
        # Both are float16 gradients of the float32 model: close to it, not equal.
        np.testing.assert_allclose(b, ref, rtol=0.1, atol=2e-2)
    # The whole step: parameters and scaler move the same way in both.
    np.testing.assert_allclose(float(loss_hand), float(loss_ours), rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(s_hand["params"]), jax.tree_util.tree_leaves(s_ours["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert float(s_hand["scaler"]["scale"]) == float(s_ours["scaler"].scale) == 128.0


def test_count_hlo_ops_counts_instructions_only():
    text = "HloModule m\n\nENTRY %main (p: f32[2]) -> f32[2] {\n  %p = f32[2] parameter(0)\n" \
           "  ROOT %n = f32[2] negate(f32[2] %p)\n}\n"
    assert vit.count_hlo_ops(text) == 2


@pytest.mark.slow  # about three minutes on 2 CPU cores
def test_quick_run_writes_results_for_every_variant(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(
        [sys.executable, "-m", "benchmarks.vit", "--out", str(tmp_path), "--quick", "--no-progress"],
        cwd=ROOT, env=env, check=True, capture_output=True, timeout=600,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    records = results["records"]
    variants = vit.available_variants()
    required = ("config", "batch_size", "variant", "saved_activation_bytes", "half_matmul_flop_share",
                "step_time_s", "epoch_time_s", "backend", "xla_total_bytes", "hlo_ops",
                "grad_norm_ratio_vs_float32")
    batch_sizes = sorted({r["batch_size"] for r in records})
    assert len(batch_sizes) >= 2
    assert sorted((r["batch_size"], r["variant"]) for r in records) == sorted(
        (b, v) for b in batch_sizes for v in variants
    )
    for r in records:
        assert all(r.get(k) is not None for k in required), r
        assert r["config"] == "tiny" and r["backend"] == jax.default_backend()
        assert r["step_time_s"] > 0
    for key in ("cpu", "cores", "jax_version"):
        assert results["machine"][key]
    by = {(r["batch_size"], r["variant"]): r for r in records}
    for b in batch_sizes:
        assert by[b, "float32"]["saved_activation_bytes"] / by[b, "jaxmp"]["saved_activation_bytes"] > 1.5
        assert by[b, "jaxmp"]["half_matmul_flop_share"] > 0.9
        assert by[b, "float32"]["half_matmul_flop_share"] == 0.0
    # Unscaling with this step's scale: the gradient norm is float32's.
    assert abs(by[batch_sizes[0], "jaxmp"]["grad_norm_ratio_vs_float32"] - 1.0) < 0.02
    assert any(name.endswith(".png") for name in os.listdir(tmp_path))


def test_plain_vit_is_the_same_model_with_the_promotion_trap():
    params = models.init_vit(jax.random.key(0), CONFIG)
    images, labels = _batch(4)
    plain = models.plain_vit_loss(params, images, labels, CONFIG)
    np.testing.assert_allclose(float(plain), float(models.vit_loss(params, images, labels, CONFIG)), rtol=1e-4)
    # Cast to float16, the NumPy float64 scale sends the attention back to float32;
    # autocast puts every matrix product in half precision.
    hand = vit.make_variant("hand_written", CONFIG, model="plain_vit")
    auto = vit.make_variant("autocast", CONFIG, model="plain_vit")
    assert jaxmp.debug.half_matmul_flop_share(jax.grad(hand.loss), params, images, labels) < 0.5
    assert jaxmp.debug.half_matmul_flop_share(jax.grad(auto.loss), params, images, labels) == 1.0


def test_comparison_table_reports_per_round_ratios_to_the_hand_written_step():
    def record(variant, times, **extra):
        return {"config": "tiny", "model": "vit", "batch_size": 8, "variant": variant,
                "saved_activation_bytes": 2**20, "half_matmul_flop_share": 1.0, "hlo_ops": 100,
                "xla_total_bytes": 2**21, "step_times_s": times, "step_time_s": sorted(times)[1],
                "large_activation_loss": 1.0, "large_activation_loss_float32": 1.0, **extra}

    results = {"records": [record("hand_written", [1.0, 2.0, 1.0]),
                           record("autocast", [1.1, 2.0, 1.3], hlo_ops=120)]}
    table = vit.comparison_table(results, "tiny")
    assert "| vit | 8 | autocast | 1 | n/a | 1.000 | 2 | 1.00x | 120 | 1.20x | 1.300 | 1.10x (1.00-1.30) |" in table


def test_comparison_table_without_float32_among_the_variants():
    # `--variants hand_written,autocast`: no float32 record, so no float32 loss
    # or saved-bytes ratio to compare with; the table says n/a (it used to crash).
    def record(variant, loss):
        return {"config": "desktop", "model": "vit", "batch_size": 64, "variant": variant,
                "saved_activation_bytes": 2**20, "half_matmul_flop_share": 1.0, "hlo_ops": 100,
                "xla_total_bytes": None, "step_times_s": None, "step_time_s": None,
                "saved_bytes_ratio_vs_float32": None,
                "large_activation_loss": loss, "large_activation_loss_float32": None}

    results = {"records": [record("hand_written", 12.125), record("autocast", 14.5)]}
    table = vit.comparison_table(results, "desktop")
    assert "| vit | 64 | autocast | 1 | n/a | 1.000 | n/a | n/a | 100 | 1.00x | n/a | n/a | n/a | n/a | 14.500 |" in table
    assert "| 12.125 |" in table
