"""The compiled training step stays the size of a hand-written one.

A refactor once tripled jaxmp's optimised program (a finiteness flag that XLA
copied into every parameter update) and no test noticed. These tests count
instructions in the optimised HLO, which is deterministic for a JAX version,
never time: jaxmp's step, with autocast (the default) and without, against
the same float16 recipe written by hand, on the benchmark's tiny ViT.
"""

import functools
import re

import jax
import pytest

from benchmarks import models
from benchmarks import vit

# The benchmark's target is 1.10x; the bound leaves room for XLA versions
# (CI also runs the oldest supported JAX) and still fails on a 1.5x bloat.
MAX_RATIO = 1.2


@pytest.fixture(scope="module")
def compiled():
    config = models.TINY_VIT
    params = jax.eval_shape(functools.partial(models.init_vit, config=config), jax.random.key(0))
    x, y = vit.batch_shapes(config, 4)
    out = {}
    for name in ("hand_written", "jaxmp", "autocast"):
        variant = vit.make_variant(name, config)
        state = jax.eval_shape(variant.init, params)
        step = jax.jit(variant.step, donate_argnums=0)
        out[name] = (step.trace(state, x, y).jaxpr, step.lower(state, x, y).compile().as_text())
    return out


@pytest.mark.parametrize("name", ["jaxmp", "autocast"])
def test_step_is_within_a_fifth_of_the_hand_written_step(compiled, name):
    hand = vit.count_hlo_ops(compiled["hand_written"][1])
    ours = vit.count_hlo_ops(compiled[name][1])
    assert ours <= MAX_RATIO * hand, f"{name}: {ours} HLO instructions, hand-written {hand}"


@pytest.mark.parametrize("name", ["jaxmp", "autocast"])
def test_healthy_step_has_no_host_callback_nor_conditional(compiled, name):
    # float32 master weights: nothing to call back about, no branch to take.
    jaxpr, hlo = compiled[name]
    assert "callback" not in str(jaxpr) and " cond[" not in str(jaxpr)
    assert not re.search(r"\b(custom-call|conditional)\(", hlo)


@pytest.mark.parametrize("name", ["jaxmp", "autocast"])
def test_finite_flag_is_computed_once(compiled, name):
    # The regression: XLA copied the flag's and-chain (one ``and`` per parameter)
    # into each of the ~100 selects of the update: thousands of ``and``s.
    hand_ands = compiled["hand_written"][1].count(" and(")
    assert compiled[name][1].count(" and(") <= 2 * hand_ands + 20
