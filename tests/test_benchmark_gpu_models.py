"""Tests of issue 41's models in ``benchmarks/gpu_program.py`` (``benchmarks/gpu_models.py``)
and of the split of its estimate into GEMM time and the other kernels by what they do."""

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from benchmarks import gpu_models
from benchmarks import gpu_program as bench
from jaxmp._src import gpu_program as gp

# --- The kernels of a hand-made program, one of each class --------------------------------------

_KERNELS = """HloModule m, is_scheduled=true

%max (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %m = bf16[] maximum(%a, %b)
}

%fused_amax (p0: bf16[64,32]) -> bf16[] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %abs.1 = bf16[64,32]{1,0} abs(%p0), metadata={op_name="jit(step)/jvp()/abs"}
  %c = bf16[] constant(-inf)
  ROOT %r = bf16[] reduce(%abs.1, %c), dimensions={0,1}, to_apply=%max, metadata={op_name="jit(step)/jvp()/reduce_max"}
}

%fused_quantise (p0: bf16[64,32], p1: bf16[]) -> f8e4m3fn[64,32] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[] parameter(1)
  %b = bf16[64,32]{1,0} broadcast(%p1), dimensions={}
  %d = bf16[64,32]{1,0} divide(%p0, %b), metadata={op_name="jit(step)/jvp()/div"}
  ROOT %q = f8e4m3fn[64,32]{1,0} convert(%d), metadata={op_name="jit(step)/jvp()/convert_element_type"}
}

%fused_transpose (p0: f8e4m3fn[64,32]) -> f8e4m3fn[32,64] {
  %p0 = f8e4m3fn[64,32]{1,0} parameter(0)
  ROOT %t = f8e4m3fn[32,64]{1,0} transpose(%p0), dimensions={1,0}
}

%fused_norm (p0: f32[64,32], p1: f32[64]) -> bf16[64,32] {
  %p0 = f32[64,32]{1,0} parameter(0)
  %p1 = f32[64]{0} parameter(1)
  %r = f32[64]{0} rsqrt(%p1), metadata={op_name="jit(step)/jvp()/rsqrt"}
  %b = f32[64,32]{1,0} broadcast(%r), dimensions={0}
  %m = f32[64,32]{1,0} multiply(%p0, %b), metadata={op_name="jit(step)/jvp()/mul"}
  ROOT %c = bf16[64,32]{1,0} convert(%m), metadata={op_name="jit(step)/jvp()/convert_element_type"}
}

%fused_adam (p0: f32[64,32], p1: f32[64,32]) -> f32[64,32] {
  %p0 = f32[64,32]{1,0} parameter(0)
  %p1 = f32[64,32]{1,0} parameter(1)
  %s = f32[64,32]{1,0} sqrt(%p1), metadata={op_name="jit(step)/sqrt"}
  ROOT %d = f32[64,32]{1,0} divide(%p0, %s), metadata={op_name="jit(step)/div"}
}

%fused_cast (p0: f32[64,32]) -> bf16[64,32] {
  %p0 = f32[64,32]{1,0} parameter(0)
  ROOT %c = bf16[64,32]{1,0} convert(%p0), metadata={op_name="jit(step)/jvp()/convert_element_type"}
}

%fused_finite (p0: f32[64,32]) -> pred[64,32] {
  %p0 = f32[64,32]{1,0} parameter(0)
  ROOT %f = pred[64,32]{1,0} is-finite(%p0), metadata={op_name="jit(step)/cond/branch_0_fun/is_finite"}
}

%fused_gelu (p0: bf16[64,32]) -> bf16[64,32] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  ROOT %t = bf16[64,32]{1,0} tanh(%p0), metadata={op_name="jit(step)/jvp()/tanh"}
}

ENTRY %main (x: bf16[64,32], w: f32[64,32], v: f32[64], g: bf16[32,16]) -> bf16[64,16] {
  %x = bf16[64,32]{1,0} parameter(0)
  %w = f32[64,32]{1,0} parameter(1)
  %v = f32[64]{0} parameter(2)
  %g = bf16[32,16]{1,0} parameter(3)
  %amax_fusion = bf16[] fusion(%x), kind=kInput, calls=%fused_amax, metadata={op_name="jit(step)/jvp()/reduce_max"}
  %quantise_fusion = f8e4m3fn[64,32]{1,0} fusion(%x, %amax_fusion), kind=kLoop, calls=%fused_quantise, metadata={op_name="jit(step)/jvp()/convert_element_type"}
  %transpose_fusion = f8e4m3fn[32,64]{1,0} fusion(%quantise_fusion), kind=kInput, calls=%fused_transpose
  %norm_fusion = bf16[64,32]{1,0} fusion(%w, %v), kind=kLoop, calls=%fused_norm, metadata={op_name="jit(step)/jvp()/mul"}
  %adam_fusion = f32[64,32]{1,0} fusion(%w, %w), kind=kLoop, calls=%fused_adam, metadata={op_name="jit(step)/div"}
  %cast_fusion = bf16[64,32]{1,0} fusion(%w), kind=kLoop, calls=%fused_cast, metadata={op_name="jit(step)/jvp()/convert_element_type"}
  %finite_fusion = pred[64,32]{1,0} fusion(%w), kind=kLoop, calls=%fused_finite, metadata={op_name="jit(step)/cond/branch_0_fun/is_finite"}
  %gelu_fusion = bf16[64,32]{1,0} fusion(%x), kind=kLoop, calls=%fused_gelu, metadata={op_name="jit(step)/jvp()/tanh"}
  %gemm = (bf16[64,16]{1,0}, s8[1024]{0}) custom-call(%gelu_fusion, %g), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}, metadata={op_name="jit(step)/jvp()/dot_general"}
  ROOT %out = bf16[64,16]{1,0} get-tuple-element(%gemm), index=0
}
"""

_CLASSES = {"amax_fusion": "amax", "quantise_fusion": "quantise",
            "transpose_fusion": "transpose", "norm_fusion": "normalisation",
            "adam_fusion": "optimizer", "cast_fusion": "cast", "finite_fusion": "other",
            "gelu_fusion": "other"}


def test_classify_names_what_each_kernel_does():
    ops = bench.kernel_ops(_KERNELS)
    program = jaxmp.debug.GpuProgram.from_hlo(_KERNELS, "h100")
    kernels = {k.name: k for k in program.kernels}
    assert set(_CLASSES) <= set(kernels)
    got = {name: bench.classify(ops[name], kernels[name].op_name) for name in _CLASSES}
    assert got == _CLASSES
    assert set(got.values()) <= set(bench.KERNEL_CLASSES)


def test_classify_reads_a_module_scope_and_a_copy():
    op = bench.Op("multiply", "f32[8]", "jit(step)/transpose(jvp(ResNet))/BatchNorm_0/mul")
    assert bench.classify([op], op.op_name) == "normalisation"
    op = bench.Op("reduce", "f32[8]", "jit(step)/transpose(jvp(ResNet))/bn_init/reduce_sum")
    assert bench.classify([op], op.op_name) == "normalisation"
    op = bench.Op("reduce", "f32[8]", "jit(step)/transpose(jvp(ResNet))/Dense_0/reduce_sum")
    assert bench.classify([op], op.op_name) == "other"
    assert bench.classify([bench.Op("copy", "bf16[8,4]", "")]) == "transpose"


def test_time_split_adds_up_to_the_estimate():
    program = jaxmp.debug.GpuProgram.from_hlo(_KERNELS, "h100")
    split = bench.time_split(program, top=3)
    gemm = next(k for k in program.kernels if k.products)
    assert split["gemm_ms"] == pytest.approx(1e3 * program.kernel_seconds(gemm))
    assert split["gemm_ms"] + split["non_gemm_ms"] == pytest.approx(
        1e3 * program.estimated_seconds, rel=1e-12)
    by_class = split["non_gemm_by_class"]
    assert sum(c["kernels"] for c in by_class.values()) == len(_CLASSES)
    assert sum(c["ms"] for c in by_class.values()) == pytest.approx(split["non_gemm_ms"])
    assert len(split["top_non_gemm"]) == 3
    times = [t["ms"] for t in split["top_non_gemm"]]
    assert times == sorted(times, reverse=True)


def test_ratios_are_the_issues_table():
    rows = [{"model": "m", "target": "h100", "variant": v, "estimated_ms": ms,
             "bytes_written": 1.0, "gemm_ms": ms / 2, "non_gemm_ms": ms / 2}
            for v, ms in (("bf16_hand", 10.0), ("bf16_jaxmp", 12.0), ("fp8_jaxmp", 9.0))]
    (entry,) = bench.ratios(rows)
    assert entry["jaxmp bf16 / hand bf16"]["estimated_ms"] == 1.2
    assert entry["float8 / jaxmp bf16"]["estimated_ms"] == 0.75
    assert "MXFP8 / jaxmp bf16" not in entry
    assert "| m | h100 | 1.20x | 0.75x | – |" in bench.ratio_table([entry])


def test_every_new_model_is_a_benchmark_model():
    assert set(gpu_models.SPECS) <= set(bench.MODELS)
    with pytest.raises(ValueError, match="the models are"):
        gpu_models.spec("alexnet")


def test_full_size_shapes_are_the_issues():
    llama = gpu_models.LLAMA_7B_BLOCK
    assert (llama.width, llama.heads, llama.ffn, llama.depth, llama.vocab, llama.seq,
            llama.batch) == (4096, 32, 11008, 2, 32000, 2048, 2)
    gpt = gpu_models.GPT_SMALL
    assert (gpt.width, gpt.heads, gpt.depth, gpt.seq, gpt.batch, gpt.vocab) == (
        768, 12, 4, 1024, 8, 32000)
    params = jax.eval_shape(gpu_models.spec("resnet50").init, jax.random.key(0))
    count = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))
    assert 25.5e6 < count < 25.6e6  # ResNet-50's 25.56M parameters
    small = jax.eval_shape(gpu_models.spec("scan_decoder_small").init, jax.random.key(0))
    assert small["layers"]["query"]["kernel"].shape == (4, 128, 128)  # stacked by nn.scan


# --- The steps, on the CPU: the twin and jaxmp compute the float32 loss -------------------------


def _inputs(spec):
    rng = np.random.default_rng(0)
    high = getattr(spec.config, "vocab", getattr(spec.config, "num_classes", 10))
    return [jnp.asarray(rng.integers(0, high, b.shape), b.dtype)
            if jnp.issubdtype(b.dtype, jnp.integer) else
            jnp.asarray(rng.standard_normal(b.shape), b.dtype) for b in spec.batch]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt_small", "resnet50", "scan_decoder"])
def test_twin_and_jaxmp_steps_compute_the_float32_loss(name):
    """The first loss and gradients of the hand-written twin and of jaxmp's steps are the
    float32 model's within bfloat16 rounding."""
    spec = gpu_models.spec(name, quick=True)
    params, inputs = spec.init(jax.random.key(0)), _inputs(spec)
    reference, grads = jax.jit(jax.value_and_grad(spec.loss))(params, *inputs)
    hand = spec.hand_loss or (lambda p, *b: spec.loss(bench._cast_floats(p, jnp.bfloat16), *b))
    hand_value, hand_grads = jax.jit(jax.value_and_grad(hand))(params, *inputs)
    grad_fn = jaxmp.mp_value_and_grad(spec.loss, compute_dtype=jnp.bfloat16)
    value, mp_grads, _, finite = jax.jit(grad_fn)(params, *inputs,
                                                  scaler_state=jaxmp.scaler_for(jnp.bfloat16))
    assert bool(finite)
    for got, their in ((hand_value, hand_grads), (value, mp_grads)):
        assert float(got) == pytest.approx(float(reference), rel=0.02)
        num = sum(float(jnp.sum(jnp.square(a.astype(jnp.float32) - b)))
                  for a, b in zip(jax.tree_util.tree_leaves(their),
                                  jax.tree_util.tree_leaves(grads)))
        den = sum(float(jnp.sum(jnp.square(b))) for b in jax.tree_util.tree_leaves(grads))
        # The relative error of the gradients: bfloat16's size (batch norm over the tiny
        # ResNet's batch of two amplifies it to about 0.1); a wrong twin is off by O(1).
        assert math.sqrt(num / den) < 0.2, name


def test_the_hand_written_step_runs_the_models_own_twin():
    """``bf16_hand`` differentiates ``hand_loss`` where a model has one, and otherwise the
    loss on parameters cast to bfloat16."""
    loss = lambda w, x: jnp.sum(w * x)  # noqa: E731
    twin = lambda w, x: 2.0 * jnp.sum(w * x)  # noqa: E731
    w, x = jnp.full((4,), 0.5, jnp.float32), jnp.ones((4,), jnp.float32)
    for hand, expected in ((twin, 4.0), (None, 2.0)):
        init, step = bench.make_step(loss, "bf16_hand", hand_loss=hand)
        state, value = jax.jit(step)(init(w), x)
        assert float(value) == expected
        assert state["params"].dtype == jnp.float32
    assert bench.hand_loss("resnet50", quick=True).keywords["dtype"] == jnp.bfloat16
    assert bench.hand_loss("llama", quick=True) is None and bench.hand_loss("gpt") is None


def test_resnet_twin_is_flax_bfloat16():
    """The ResNet's twin is the module with ``dtype=jnp.bfloat16`` on float32 parameters."""
    spec = gpu_models.spec("resnet50", quick=True)
    params = jax.eval_shape(spec.init, jax.random.key(0))
    images, _ = spec.batch
    module = gpu_models._resnet(spec.config, jnp.bfloat16)
    with jax.numpy_dtype_promotion("standard"):
        logits, _ = jax.eval_shape(functools.partial(module.apply, mutable=["batch_stats"]),
                                   {"params": params}, images)
    assert logits.dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.float32)}
    assert spec.hand_loss.keywords["dtype"] == jnp.bfloat16


# --- The deviceless H100 programs of the tiny configurations -------------------------------------

needs_plugin = pytest.mark.skipif(
    not gp.plugin_installed(),
    reason="needs JAX's CUDA plugin to compile for a GPU without one: "
           "pip install -e '.[gpu-compile]' (and JAX_PLATFORMS=cpu on a machine without a GPU)")


@functools.lru_cache(maxsize=None)
def _program(model: str, variant: str) -> jaxmp.debug.GpuProgram:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bench.compile_step(model, variant, "h100", quick=True)


@pytest.mark.gpu_program
@needs_plugin
def test_float8_kernels_are_found_in_the_llama_step():
    """The float8 step's non-GEMM time has amax reductions and quantise passes, the
    hand-written bfloat16 step's has none; each split adds up to the estimate."""
    splits = {}
    for variant in ("bf16_hand", "fp8_jaxmp"):
        program = _program("llama", variant)
        split = splits[variant] = bench.time_split(program)
        assert split["gemm_ms"] + split["non_gemm_ms"] == pytest.approx(
            1e3 * program.estimated_seconds)
        assert split["gemm_ms"] > 0
    assert {"amax", "quantise"} <= set(splits["fp8_jaxmp"]["non_gemm_by_class"])
    assert not {"amax", "quantise"} & set(splits["bf16_hand"]["non_gemm_by_class"])
    assert "optimizer" in splits["bf16_hand"]["non_gemm_by_class"]


@pytest.mark.gpu_program
@needs_plugin
def test_batch_norm_kernels_are_found_in_the_resnet_step():
    program = _program("resnet50", "bf16_hand")
    split = bench.time_split(program)
    assert split["non_gemm_by_class"]["normalisation"]["kernels"] >= 5  # 5 batch norms
    assert any(p.kind.startswith("convolution") for p in program.products)


@pytest.mark.slow
def test_cpu_memory_of_the_scanned_decoder():
    """The issue's measure: XLA's memory and HLO instructions of the step compiled here."""
    row = bench.cpu_memory("scan_decoder", "bf16_hand", quick=True)
    assert row["total_bytes"] >= row["temp_bytes"] > 0
    assert row["hlo_instructions"] > 100
