"""The scale benchmark (benchmarks/scale.py): a quick run measures every variant it runs."""

import dataclasses
import json
import subprocess
import sys

import pytest

from benchmarks import models
from benchmarks import scale
from benchmarks import vit

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


# --- Deterministic guards of issue 33's cost targets (program sizes, never timings) -------------
#
# The tiny decoder (width 32, 2 heads, sequence 16) at a few depths: a program's size per layer is
# what grows with depth, so the ratios per layer are the ratios at any depth.

TINY = models.GPTConfig(vocab=64, seq=16, width=32, depth=1, heads=2, batch=2)


def _traced(name, depth, layout="unrolled", config=TINY):
    _, jitted, state, batch = scale._build(name, dataclasses.replace(config, depth=depth),
                                           layout == "scan")
    return jitted.trace(state, *batch)


def _eqns(name, depth, layout="unrolled"):
    return scale.count_eqns(_traced(name, depth, layout).jaxpr)


def _hlo_ops(name, depth):
    return vit.count_hlo_ops(_traced(name, depth).lower().compile().as_text())


def test_default_step_grows_linearly_and_like_the_hand_written_step():
    hand = {d: _eqns("hand_dyn", d) for d in (2, 4)}
    ours = {d: _eqns("autocast", d) for d in (2, 4, 6)}
    # Every layer adds the same equations (within one: jax 0.8 adds 1,266 then 1,265):
    # growth is linear.
    assert abs((ours[6] - ours[4]) - (ours[4] - ours[2])) <= 2, ours
    per_layer = (ours[4] - ours[2]) / (hand[4] - hand[2])
    assert per_layer <= 1.10, per_layer  # measured 1.07 (jax 0.12)
    for d in (2, 4):
        assert ours[d] <= 1.12 * hand[d], (d, ours[d], hand[d])  # measured 1.09-1.11


@pytest.mark.slow  # compiles four programs
def test_default_step_program_size_per_layer():
    hand = {d: _hlo_ops("hand_dyn", d) for d in (2, 4)}
    ours = {d: _hlo_ops("autocast", d) for d in (2, 4)}
    for d in (2, 4):
        assert ours[d] <= 1.15 * hand[d], (d, ours[d], hand[d])  # measured 1.10-1.13
    per_layer = (ours[4] - ours[2]) / (hand[4] - hand[2])
    assert per_layer <= 1.15, per_layer  # measured 1.07


def test_scanned_step_does_not_grow_with_depth():
    assert _eqns("autocast", 2, "scan") == _eqns("autocast", 4, "scan")


@pytest.mark.slow  # compiles two programs
def test_scanned_default_step_needs_no_more_memory_than_the_hand_written_one():
    # Before autocast recomputed the float32 regions inside a scan body: 1.19x.
    config = models.GPTConfig(vocab=64, seq=64, width=64, depth=4, heads=2, batch=2)
    memory = {name: vit.xla_memory(_traced(name, 4, "scan", config).lower().compile())
              for name in ("hand_dyn", "autocast")}
    ratio = memory["autocast"]["xla_total_bytes"] / memory["hand_dyn"]["xla_total_bytes"]
    assert ratio <= 1.05, ratio  # measured 1.026 (jax 0.12, XLA:CPU)


@pytest.mark.slow  # compiles four programs
def test_float8_program_per_layer_against_bfloat16():
    # Issue 33's target is 1.7x; this guards what is reached (1.83x) against growing.
    bf16 = {d: _hlo_ops("bf16", d) for d in (2, 4)}
    f8 = {d: _hlo_ops("float8", d) for d in (2, 4)}
    per_layer = (f8[4] - f8[2]) / (bf16[4] - bf16[2])
    assert per_layer <= 1.9, per_layer
