"""The compiled training step stays the size of a hand-written one.

A refactor once tripled jaxmp's optimised program (a finiteness flag that XLA
copied into every parameter update) and no test noticed. These tests count
instructions in the optimised HLO and read XLA's memory estimate, both
deterministic for a JAX version, never time: jaxmp's step, with autocast (the
default) and without, against the same float16 recipe written by hand, on the
benchmark's tiny ViT.
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
# The benchmark's target is 1.0x. Before autocast tied its recomputation to the
# cotangents, XLA ran it in the forward pass and this batch gave 1.10x.
MAX_MEMORY_RATIO = 1.03


@pytest.fixture(scope="module")
def compiled():  # the three steps of the benchmark's tiny ViT, traced and compiled
    config = models.TINY_VIT
    params = jax.eval_shape(functools.partial(models.init_vit, config=config), jax.random.key(0))
    x, y = vit.batch_shapes(config, 32)
    out = {}
    for name in ("hand_written", "jaxmp", "autocast"):
        variant = vit.make_variant(name, config)
        state = jax.eval_shape(variant.init, params)
        step = jax.jit(variant.step, donate_argnums=0)
        exe = step.lower(state, x, y).compile()
        out[name] = (step.trace(state, x, y).jaxpr, exe.as_text(),
                     vit.xla_memory(exe)["xla_total_bytes"])
    return out


def test_step_stays_the_size_of_a_hand_written_one(compiled):
    # One test, so that the three steps compile once whichever worker runs it.
    _, hand_hlo, hand_mem = compiled["hand_written"]
    hand, hand_ands = vit.count_hlo_ops(hand_hlo), hand_hlo.count(" and(")
    for name in ("jaxmp", "autocast"):
        jaxpr, hlo, mem = compiled[name]
        ours = vit.count_hlo_ops(hlo)
        assert ours <= MAX_RATIO * hand, f"{name}: {ours} HLO instructions, hand-written {hand}"
        # No float32 copies kept from the forward pass to the backward one.
        ratio = mem / hand_mem
        assert ratio <= MAX_MEMORY_RATIO, f"{name}: XLA memory estimate {ratio:.3f}x hand-written"
        # float32 master weights: nothing to call back about, no branch to take.
        assert "callback" not in str(jaxpr) and " cond[" not in str(jaxpr), name
        assert not re.search(r"\b(custom-call|conditional)\(", hlo), name
        # The regression: XLA copied the flag's and-chain (one ``and`` per parameter)
        # into each of the ~100 selects of the update: thousands of ``and``s.
        assert hlo.count(" and(") <= 2 * hand_ands + 20, name
