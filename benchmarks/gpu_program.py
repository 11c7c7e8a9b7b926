"""What an H100 or B200 runs of jaxmp's training steps, compiled here without a GPU.

For each model (``gpt``: the GPT-style decoder of ``benchmarks/models.py``,
width 1024, 2 blocks, 16 heads, sequence 1024, batch 8, vocabulary 32768;
``resnet``: its small ResNet, 32x32x3 images, stages 64/128/256, batch 128;
and the models users train, from ``benchmarks/gpu_models.py``: ``llama``, a
LLaMA-7B-shaped block, ``gpt_small``, ``resnet50`` in Flax linen, and
``scan_decoder`` / ``scan_decoder_small``, MaxText-style layers under
``nn.remat`` inside ``nn.scan``) and each variant of one training step
(gradient + Adam update, the state donated):

* ``float32``: ``jax.value_and_grad`` on float32 parameters;
* ``bf16_hand``: bfloat16 written by hand: the float32 parameters (and images)
  cast to bfloat16 inside the loss (``resnet50``: Flax's own
  ``dtype=jnp.bfloat16``); the models keep layer-norm and batch-norm
  statistics, the softmax and the loss in float32, as experts write them; no
  finiteness check;
* ``bf16_jaxmp``: ``jaxmp.mp_value_and_grad(loss, compute_dtype=jnp.bfloat16)``
  (jaxmp's default: autocast, finiteness check) and ``jaxmp.optimizer_update``;
* ``f16_jaxmp``: the same in float16 (dynamic loss scaling);
* ``fp8_jaxmp``: ``bf16_jaxmp`` with ``matmul_dtype=jnp.float8_e4m3fn``
  (per-tensor scaling);
* ``mxfp8_jaxmp``: the same with ``float8_scaling="mxfp8"``;
* ``nvfp4_jaxmp``: ``bf16_jaxmp`` with ``matmul_dtype=jnp.float4_e2m1fn,
  float8_scaling="nvfp4"`` (NVIDIA's 4-bit recipe),
* ``fp8_delayed_jaxmp``: ``fp8_jaxmp`` with ``float8_scaling="delayed"`` (scales from an
  amax history that the step carries in its state, ``init_float8_state``),

it compiles the step for each target (``h100``: sm_90, ``b200``: sm_100) with
:func:`jaxmp.debug.gpu_program` (JAX's CUDA plugin, no GPU; XLA's default settings,
no autotuning) and prints and saves the census of the optimized program: how
every matrix product and convolution is compiled and on which operand types,
the float8-native share of product FLOPs, kernels launched, bytes written and
read, XLA's scratch memory and the estimated step time, split into the time of
the kernels that run products (GEMMs and convolutions) and the rest, the rest by
what its kernels do (:func:`classify`: transpose, quantise, amax, normalisation,
optimizer, cast, other) with its slowest kernels; and the ratios of issue 41's
table (jaxmp bf16 / hand bf16, float8 / jaxmp bf16, MXFP8 / jaxmp bf16).
``--resplit DIR`` re-classifies a run's saved HLO without compiling.

``--calibrate DIR --measured FILE`` instead reads optimized HLO files compiled
on a real GPU (``DIR/<model>_<variant>.hlo``) and step times measured there
(JSON lines with ``model``, ``variant``, ``step_ms_median``, as
``gpu_check.sh`` writes them) and prints the estimate against the measurement.

Usage::

    python -m benchmarks.gpu_program --target h100,b200 --out results/gpu_program
    python -m benchmarks.gpu_program --target h100 --out results/gpu_program-quick --quick
    python -m benchmarks.gpu_program --target h100,b200 --models llama,gpt_small,resnet50 \
        --variants bf16_hand,bf16_jaxmp,fp8_jaxmp,mxfp8_jaxmp --out results/issue41
    python -m benchmarks.gpu_program --calibrate gc/hlo --measured gc/results.jsonl

Needs JAX's CUDA plugin (``pip install -e ".[gpu-compile]"``) and
``JAX_PLATFORMS=cpu`` on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import re
import sys
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

import jaxmp
from benchmarks import gpu_models, models

VARIANTS = ("float32", "bf16_hand", "bf16_jaxmp", "f16_jaxmp", "fp8_jaxmp", "mxfp8_jaxmp",
            "nvfp4_jaxmp", "fp8_delayed_jaxmp")
MODELS = ("gpt", "resnet") + gpu_models.SPECS
TARGETS = ("h100", "b200")

# jaxmp's options for each of its variants: a new variant is a new row.
_JAXMP = {
    "bf16_jaxmp": {"compute_dtype": jnp.bfloat16},
    "f16_jaxmp": {"compute_dtype": jnp.float16},
    "fp8_jaxmp": {"compute_dtype": jnp.bfloat16, "matmul_dtype": jnp.float8_e4m3fn},
    "mxfp8_jaxmp": {"compute_dtype": jnp.bfloat16, "matmul_dtype": jnp.float8_e4m3fn,
                    "float8_scaling": "mxfp8"},
    "nvfp4_jaxmp": {"compute_dtype": jnp.bfloat16, "matmul_dtype": jnp.float4_e2m1fn,
                    "float8_scaling": "nvfp4"},
    "fp8_delayed_jaxmp": {"compute_dtype": jnp.bfloat16, "matmul_dtype": jnp.float8_e4m3fn,
                          "float8_scaling": "delayed"},
}


def _cast_floats(tree, dtype):
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def make_step(loss: Callable, variant: str, optimizer=None,
              hand_loss: Callable | None = None, batch: Any = (),
              float8_rules: Any = None) -> tuple[Callable, Callable]:
    """``(init, step)`` of a variant: ``init(params) -> state``, ``step(state, *batch) ->
    (state, loss)``; ``loss(params, *batch)`` is the float32 model's loss, ``hand_loss``
    the model's own hand-written bfloat16 loss where it has one (Flax's ``dtype=``; by
    default ``loss`` on the parameters and floating inputs cast to bfloat16). ``batch``
    (shapes) sizes the amax history of ``fp8_delayed_jaxmp``, which the state carries;
    ``float8_rules`` goes to the float8 variants' ``mp_value_and_grad``."""
    optimizer = optimizer or optax.adam(1e-4)
    if variant in ("float32", "bf16_hand"):
        if variant == "float32":
            value_and_grad = jax.value_and_grad(loss)
        elif hand_loss is not None:
            value_and_grad = jax.value_and_grad(hand_loss)
        else:
            value_and_grad = jax.value_and_grad(
                lambda p, *batch: loss(_cast_floats(p, jnp.bfloat16),
                                       *_cast_floats(batch, jnp.bfloat16)))

        def init(params):
            return {"params": params, "opt_state": optimizer.init(params)}

        def step(state, *batch):
            value, grads = value_and_grad(state["params"], *batch)
            with jax.numpy_dtype_promotion("standard"):  # optax relies on it internally
                updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
                params = optax.apply_updates(state["params"], updates)
            return {"params": params, "opt_state": opt_state}, value

        return init, step
    if variant not in _JAXMP:
        raise ValueError(f"unknown variant {variant!r}; the variants are {VARIANTS}")
    options = _JAXMP[variant]
    if float8_rules is not None:
        options = {**options, "float8_rules": float8_rules}
    grad_fn = jaxmp.mp_value_and_grad(loss, **options)

    delayed = options.get("float8_scaling") == "delayed"

    def init(params):
        state = {"params": params, "opt_state": optimizer.init(params),
                 "scaler": jaxmp.scaler_for(options["compute_dtype"])}
        if delayed:
            example = [jnp.zeros(b.shape, b.dtype) for b in batch]
            state["float8"] = jaxmp.experimental.init_float8_state(loss, params, *example)
        return state

    def step(state, *batch):
        extra = {"float8_state": state["float8"]} if delayed else {}
        value, grads, scaler, finite, *float8 = grad_fn(state["params"], *batch,
                                                        scaler_state=state["scaler"], **extra)
        params, opt_state = jaxmp.optimizer_update(state["params"], optimizer,
                                                   state["opt_state"], grads, finite)
        new = {"params": params, "opt_state": opt_state, "scaler": scaler}
        return (new | {"float8": float8[0]} if delayed else new), value

    return init, step


def model(name: str, quick: bool = False, depth: int | None = None):
    """``(loss, init_params, batch shapes, config)`` of a model of :data:`MODELS`."""
    if name in gpu_models.SPECS:
        return tuple(gpu_models.spec(name, quick))[:4]
    if name == "gpt":
        config = models.GPT_TINY if quick else models.GPT_2L
        if depth is not None:
            config = dataclasses.replace(config, depth=depth)
        return (functools.partial(models.gpt_loss, config=config),
                functools.partial(models.init_gpt, config=config), models.gpt_batch(config),
                config)
    if name == "resnet":
        config = models.RESNET_TINY if quick else models.RESNET_SMALL
        return (functools.partial(models.resnet_loss, config=config),
                functools.partial(models.init_resnet, config=config),
                models.resnet_batch(config), config)
    raise ValueError(f"unknown model {name!r}; the models are {MODELS}")


def hand_loss(name: str, quick: bool = False) -> Callable | None:
    """The model's own hand-written bfloat16 loss, ``None`` where ``bf16_hand`` casts the
    parameters of the float32 loss."""
    return gpu_models.spec(name, quick).hand_loss if name in gpu_models.SPECS else None


def compile_step(model_name: str, variant: str, target: str, quick: bool = False,
                 depth: int | None = None) -> jaxmp.debug.GpuProgram:
    """The :class:`jaxmp.debug.GpuProgram` of one training step (nothing is allocated)."""
    loss, init_params, batch, _ = model(model_name, quick, depth)
    init, step = make_step(loss, variant, hand_loss=hand_loss(model_name, quick), batch=batch)
    state = jax.eval_shape(lambda: init(init_params(jax.random.key(0))))
    return jaxmp.debug.gpu_program(jax.jit(step, donate_argnums=0), state, *batch, target=target)


def cpu_memory(model_name: str, variant: str, quick: bool = False) -> dict[str, Any]:
    """XLA's memory (``compiled.memory_analysis()``) and the optimized HLO instructions of one
    step compiled for the CPU: the issue's measure of the scanned decoder."""
    loss, init_params, batch, _ = model(model_name, quick)
    init, step = make_step(loss, variant, hand_loss=hand_loss(model_name, quick), batch=batch)
    state = jax.eval_shape(lambda: init(init_params(jax.random.key(0))))
    compiled = jax.jit(step, donate_argnums=0).lower(state, *batch).compile()
    memory = compiled.memory_analysis()
    total = (memory.argument_size_in_bytes + memory.output_size_in_bytes
             + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
    instructions = sum(1 for line in compiled.as_text().splitlines() if " = " in line)
    return {"model": model_name, "variant": variant, "target": "cpu",
            "temp_bytes": memory.temp_size_in_bytes, "total_bytes": total,
            "hlo_instructions": instructions}


def how_compiled(program: jaxmp.debug.GpuProgram) -> str:
    """The products in a few words: ``39 bf16 GEMMs``, ``20 fp8 cuDNN convs, 12 f32...``
    (``fp4``: NVFP4's float4 operands)."""
    groups: dict[str, int] = {}
    for p in program.products:
        noun = "conv" if p.kind.startswith("convolution") else "GEMM"
        if not p.tensor_cores:
            noun = f"{p.kind}s in loop fusions"
        else:
            noun = f"{p.engine} {noun}s"
        lhs, rhs = (t.replace("f8e4m3fn", "e4m3").replace("f8e5m2", "e5m2")
                    for t in (p.lhs, p.rhs))
        types = lhs if lhs == rhs else f"{lhs} x {rhs}"
        if p.float8_native:
            types = "fp4" if p.operands == ("f4e2m1fn", "f4e2m1fn") else "fp8"
        groups[f"{types} {noun}"] = groups.get(f"{types} {noun}", 0) + p.runs
    return ", ".join(f"{n} {k}" for k, n in sorted(groups.items(), key=lambda kv: -kv[1]))


# --- Where the estimate goes: GEMM time, and the other kernels by what they do -------------

# The classes of non-GEMM kernels, in the order they are tried.
KERNEL_CLASSES = ("transpose", "quantise", "amax", "normalisation", "optimizer", "cast",
                  "other")
_MOVES = frozenset({"transpose", "copy", "bitcast", "reshape", "parameter", "tuple",
                    "get-tuple-element", "pad", "slice", "dynamic-slice",
                    "dynamic-update-slice", "concatenate", "constant", "broadcast"})
_CASTS = _MOVES | {"convert"}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


class Op(NamedTuple):
    """One HLO instruction of a kernel: its opcode, result type and JAX operation."""

    opcode: str
    type: str
    op_name: str


def kernel_ops(text: str) -> dict[str, list[Op]]:
    """Every instruction of an optimized HLO module's text, with the instructions of the
    computations it fuses (``calls=``), by instruction name."""
    own: dict[str, tuple[Op, list[str]]] = {}
    bodies: dict[str, list[tuple[Op, list[str]]]] = {}
    current: list = []
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head and " = " not in line.split("{")[0]:
            current = bodies.setdefault(head.group(1), [])
            continue
        ins = _INSTRUCTION.match(line)
        if ins:
            name, type_, opcode, rest = ins.groups()
            op_name = _OP_NAME.search(rest)
            own[name] = (Op(opcode, type_, op_name.group(1) if op_name else ""),
                         _CALLS.findall(rest))
            current.append(own[name])

    def expand(op: Op, calls: list[str], depth: int = 0) -> list[Op]:
        ops = [op]
        for computation in calls if depth < 8 else ():
            for inner in bodies.get(computation, ()):
                ops.extend(expand(*inner, depth + 1))
        return ops

    return {name: expand(*entry) for name, entry in own.items()}


def classify(ops: list[Op], op_name: str = "") -> str:
    """What a non-GEMM kernel does, from its instructions (``ops``, the kernel's own first)
    and its JAX operation: one of :data:`KERNEL_CLASSES`.

    ``transpose``: only moves data (transposes, copies, pads, slices); ``quantise``: converts
    to float8; ``amax``: a maximum of absolute values; ``normalisation``: an ``rsqrt``, or
    the kernel's operation is in a ``*norm*`` or ``bn*`` module (Flax's ``BatchNorm``);
    ``optimizer``: has operations outside the forward and backward passes (not the
    finiteness check); ``cast``: only converts; ``other``: the rest (and the finiteness
    check).
    """
    opcodes = {op.opcode for op in ops} - {"fusion"}
    names = [n for n in [op.op_name for op in ops] + [op_name] if n.startswith("jit(")]
    if opcodes <= _MOVES:
        return "transpose"
    if any(op.opcode == "convert" and "f8e" in op.type for op in ops):
        return "quantise"
    if "abs" in opcodes and any(op.opcode == "reduce" and op.op_name.endswith("reduce_max")
                                for op in ops):
        return "amax"
    if "is-finite" in opcodes or any("is_finite" in n for n in names):
        return "other"
    scopes = op_name.lower().split("/")[:-1]
    if "rsqrt" in opcodes or any("norm" in m or m.startswith("bn") for m in scopes):
        return "normalisation"
    if any(not any(mark in n for mark in ("jvp(", "transpose(", "/cond/")) for n in names):
        return "optimizer"
    if opcodes <= _CASTS and "convert" in opcodes:
        return "cast"
    return "other"


def time_split(program: jaxmp.debug.GpuProgram, top: int = 10) -> dict[str, Any]:
    """The estimate split into GEMM and convolution time (kernels that run products) and
    the rest, the rest by :func:`classify`'s classes, and its ``top`` kernels by time."""
    ops = kernel_ops(program.text) if program.text else {}
    gemm = 0.0
    classes: dict[str, dict[str, float]] = {c: {"kernels": 0, "ms": 0.0}
                                            for c in KERNEL_CLASSES}
    others = []
    for k in program.kernels:
        seconds = program.kernel_seconds(k) * k.runs
        if k.products:
            gemm += seconds
            continue
        kind = classify(ops.get(k.name, [Op(k.kind, "", k.op_name)]), k.op_name)
        classes[kind]["kernels"] += k.runs
        classes[kind]["ms"] += 1e3 * seconds
        others.append({"kernel": k.name, "class": kind, "kind": k.kind, "runs": k.runs,
                       "ms": 1e3 * seconds, "op_name": k.op_name})
    others.sort(key=lambda o: -o["ms"])
    return {"gemm_ms": 1e3 * gemm, "non_gemm_ms": sum(o["ms"] for o in others),
            "non_gemm_by_class": {c: v for c, v in classes.items() if v["kernels"]},
            "top_non_gemm": others[:top]}


def row(model_name: str, variant: str, target: str, program: jaxmp.debug.GpuProgram,
        seconds: float) -> dict[str, Any]:
    """One result: the census, the split of its estimate and how long compiling took."""
    return {"model": model_name, "variant": variant, "target": target,
            "compile_s": round(seconds, 1), "products_as_compiled": how_compiled(program),
            **program.summary(), **time_split(program)}


# The ratios of estimated step time: (name, numerator, denominator).
RATIOS = (("jaxmp bf16 / hand bf16", "bf16_jaxmp", "bf16_hand"),
          ("float8 / jaxmp bf16", "fp8_jaxmp", "bf16_jaxmp"),
          ("MXFP8 / jaxmp bf16", "mxfp8_jaxmp", "bf16_jaxmp"),
          ("NVFP4 / jaxmp bf16", "nvfp4_jaxmp", "bf16_jaxmp"),
          ("delayed float8 / jaxmp bf16", "fp8_delayed_jaxmp", "bf16_jaxmp"))


def ratios(rows: list[dict]) -> list[dict]:
    """Per model and target, the ratios of :data:`RATIOS` of estimated time (and of bytes
    written, GEMM and non-GEMM time) where both variants ran."""
    by = {(r["model"], r["target"], r["variant"]): r for r in rows}
    out = []
    for model_name, target in dict.fromkeys((r["model"], r["target"]) for r in rows):
        entry = {"model": model_name, "target": target}
        for name, num, den in RATIOS:
            a, b = by.get((model_name, target, num)), by.get((model_name, target, den))
            if a and b:
                entry[name] = {key: round(a[key] / b[key], 3) if b[key] else None
                               for key in ("estimated_ms", "bytes_written", "gemm_ms",
                                           "non_gemm_ms")}
        out.append(entry)
    return out


def ratio_table(entries: list[dict]) -> str:
    """The issue's table: estimated step time ratios per model and target."""
    lines = ["| model | target | " + " | ".join(n for n, _, _ in RATIOS) + " |",
             "|---|---|" + "---|" * len(RATIOS)]
    for e in entries:
        cells = [f"{e[n]['estimated_ms']:.2f}x" if n in e else "–" for n, _, _ in RATIOS]
        lines.append(f"| {e['model']} | {e['target']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def split_table(rows: list[dict]) -> str:
    """GEMM and non-GEMM time of each program, the non-GEMM time by class."""
    lines = ["| model | variant | target | est. ms | GEMM ms | non-GEMM ms | non-GEMM by class "
             "(kernels, ms) | top non-GEMM kernels |", "|" + "---|" * 8]
    for r in rows:
        by_class = ", ".join(f"{c} {v['kernels']} {v['ms']:.2f}" for c, v in
                             sorted(r["non_gemm_by_class"].items(), key=lambda kv: -kv[1]["ms"]))
        top = ", ".join(f"{t['class']} {t['ms']:.2f}" for t in r["top_non_gemm"][:5])
        lines.append(f"| {r['model']} | {r['variant']} | {r['target']} | "
                     f"{r['estimated_ms']:.2f} | {r['gemm_ms']:.2f} | {r['non_gemm_ms']:.2f} | "
                     f"{by_class} | {top} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """A Markdown table of the results, one line per model, variant and target."""
    head = ("| model | variant | target | products as compiled | float8-native FLOPs | kernels "
            "| written GiB | read GiB | XLA temp MiB | est. ms |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        share = (f"{100 * r['float8_native_share']:.0f}%" if r["requested_float8_share"]
                 else "–")
        if r["requested_float8_share"] and r["float8_native_share"] < r["requested_float8_share"]:
            share = f"**{share}** (asked {100 * r['requested_float8_share']:.0f}%)"
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['target']} | {r['products_as_compiled']} | "
            f"{share} | {r['kernels']} | {r['bytes_written'] / 2**30:.2f} | "
            f"{r['bytes_read'] / 2**30:.2f} | {(r['temp_bytes'] or 0) / 2**20:.0f} | "
            f"{r['estimated_ms']:.2f} |")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    return {"python": platform.python_version(), "jax": jax.__version__,
            "cpus": os.cpu_count(), "host": platform.machine(),
            "platforms": os.environ.get("JAX_PLATFORMS", "")}


def run(args) -> list[dict]:
    os.makedirs(args.out, exist_ok=True)
    hlo_dir = os.path.join(args.out, "hlo")
    os.makedirs(hlo_dir, exist_ok=True)
    rows = []
    print(json.dumps(machine()), flush=True)
    with open(os.path.join(args.out, "results.jsonl"), "w") as out:
        for model_name in args.models:
            for target in args.target:
                for variant in args.variants:
                    start = time.perf_counter()
                    program = compile_step(model_name, variant, target, args.quick, args.depth)
                    seconds = time.perf_counter() - start
                    result = row(model_name, variant, target, program, seconds)
                    rows.append(result)
                    print(f"=== {model_name} / {variant} / {target} (compiled in {seconds:.0f} s)")
                    print(program, flush=True)
                    out.write(json.dumps(result) + "\n")
                    out.flush()
                    if args.save_hlo:
                        with open(os.path.join(hlo_dir, f"{model_name}_{variant}_{target}.hlo"),
                                  "w") as f:
                            f.write(program.text)
    write_tables(args.out, rows)
    return rows


def write_tables(out: str, rows: list[dict]) -> None:
    """Print the tables of ``rows`` and write them to ``out``'s results.md and ratios.json."""
    entries = ratios(rows)
    text = f"{table(rows)}\n\n{split_table(rows)}\n\n{ratio_table(entries)}"
    print(text)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(f"{json.dumps(machine())}\n\n{text}\n")
    with open(os.path.join(out, "ratios.json"), "w") as f:
        json.dump(entries, f, indent=1)


def run_cpu_memory(args) -> list[dict]:
    """:func:`cpu_memory` of each model and variant, saved as ``cpu_memory.jsonl``, with each
    variant's ratios to ``bf16_hand``."""
    os.makedirs(args.out, exist_ok=True)
    rows = [cpu_memory(m, v, args.quick) for m in args.models for v in args.variants]
    hand = {r["model"]: r for r in rows if r["variant"] == "bf16_hand"}
    lines = ["| model | variant | XLA memory MB | temp MB | HLO instructions | memory / hand | "
             "instructions / hand |", "|" + "---|" * 7]
    for r in rows:
        h = hand.get(r["model"])
        ratio = (f"{r['total_bytes'] / h['total_bytes']:.2f}x | "
                 f"{r['hlo_instructions'] / h['hlo_instructions']:.2f}x") if h else "– | –"
        lines.append(f"| {r['model']} | {r['variant']} | {r['total_bytes'] / 1e6:.1f} | "
                     f"{r['temp_bytes'] / 1e6:.1f} | {r['hlo_instructions']} | {ratio} |")
    print("\n".join(lines))
    with open(os.path.join(args.out, "cpu_memory.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(args.out, "cpu_memory.md"), "w") as f:
        f.write(f"{json.dumps(machine())}\n\n" + "\n".join(lines) + "\n")
    return rows


def resplit(out: str) -> list[dict]:
    """Re-read a run's saved HLO (``out/hlo``) and rewrite its time split and tables with
    the current :func:`classify` (no compiling)."""
    with open(os.path.join(out, "results.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for r in rows:
        path = os.path.join(out, "hlo", f"{r['model']}_{r['variant']}_{r['target']}.hlo")
        with open(path) as f:
            program = jaxmp.debug.GpuProgram.from_hlo(f.read(), r["target"])
        r.update(time_split(program))
    with open(os.path.join(out, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    write_tables(out, rows)
    return rows


def calibrate(hlo_dir: str, measured_file: str, target: str = "h100") -> list[dict]:
    """The estimate of each HLO file compiled on a GPU against the step time measured there."""
    rows = []
    with open(measured_file) as f:
        measured = [json.loads(line) for line in f if line.strip()]
    for m in measured:
        path = os.path.join(hlo_dir, f"{m['model']}_{m['variant']}.hlo")
        if m.get("step_ms_median") is None or not os.path.exists(path):
            continue
        with open(path) as f:
            program = jaxmp.debug.GpuProgram.from_hlo(f.read(), target)
        estimate = 1e3 * program.estimated_seconds
        rows.append({"model": m["model"], "variant": m["variant"],
                     "measured_ms": m["step_ms_median"], "estimated_ms": round(estimate, 2),
                     "roofline_ms": round(1e3 * program.roofline_seconds, 2),
                     "ratio": round(estimate / m["step_ms_median"], 3),
                     "kernels": program.launches,
                     "written_GiB": round(program.bytes_written / 2**30, 2),
                     "read_GiB": round(program.bytes_read / 2**30, 2)})
    print("| model | variant | measured ms | estimated ms | estimate / measured | roofline ms "
          "| kernels | written GiB | read GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['variant']} | {r['measured_ms']:.2f} | "
              f"{r['estimated_ms']:.2f} | {r['ratio']:.2f} | {r['roofline_ms']:.2f} | "
              f"{r['kernels']} | {r['written_GiB']} | {r['read_GiB']} |")
    return rows


def _names(choices):
    def parse(text):
        names = [n for n in text.split(",") if n]
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {choices}")
        return names
    return parse


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="directory for results.jsonl, results.md and hlo/")
    parser.add_argument("--target", type=_names(TARGETS), default=["h100"],
                        help="h100, b200 or both (comma-separated)")
    parser.add_argument("--models", type=_names(MODELS), default=list(MODELS))
    parser.add_argument("--variants", type=_names(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--quick", action="store_true",
                        help="tiny models (GPT width 64, one block; ResNet 8x8, stages 16/32; "
                             "each of gpu_models.py's tiny configuration)")
    parser.add_argument("--depth", type=int, default=None,
                        help="GPT blocks (default 2; the real-GPU step times used 8)")
    parser.add_argument("--no-hlo", dest="save_hlo", action="store_false",
                        help="do not save the optimized HLO of each step")
    parser.add_argument("--calibrate", metavar="HLO_DIR",
                        help="compare the estimate of GPU-compiled HLO files with --measured")
    parser.add_argument("--measured", help="JSON lines of measured step times (--calibrate)")
    parser.add_argument("--cpu-memory", action="store_true",
                        help="compile for this CPU and report XLA's memory and HLO instructions "
                             "(the issue's measure of the scanned decoder)")
    parser.add_argument("--resplit", metavar="DIR",
                        help="re-classify the kernels of a run's saved HLO, without compiling")
    args = parser.parse_args(argv)
    if args.calibrate and not args.measured:
        parser.error("--calibrate needs --measured")
    if not args.calibrate and not args.resplit and not args.out:
        parser.error("--out is required")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.calibrate:
        return calibrate(args.calibrate, args.measured)
    if args.resplit:
        return resplit(args.resplit)
    if args.cpu_memory:
        return run_cpu_memory(args)
    return run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
