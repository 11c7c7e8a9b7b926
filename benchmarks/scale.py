"""What a training step costs to trace, compile and run as a decoder gets deeper (issue 33).

The GPT-style decoder of ``benchmarks/models.py`` (``models.DECODER``: width 256,
4 heads, sequence 128, batch 8, vocabulary 1024, pre-norm blocks, GELU, causal
mask; written for any dtype, no casts) at several depths, its blocks unrolled
(a Python loop) or under ``jax.lax.scan``, trained with Adam in every way the
suite knows:

* ``float32``: ``jax.value_and_grad`` + optax;
* ``hand``: float16 written out by hand with a static loss scale (cast the
  parameters, scale the loss, divide the gradients; no finite check);
* ``hand_dyn``: ``benchmarks/vit.py``'s hand-written float16 step with a dynamic
  loss scale (finite check, scale adjustment, ``jnp.where`` between the updated
  and the old state): the yardstick;
* ``autocast``: jaxmp's default, ``mp_value_and_grad(loss,
  compute_dtype=jnp.float16)`` + ``jaxmp.optimizer_update``;
* ``cast``: the same with ``autocast=False`` (the inputs cast to float16);
* ``bf16``: jaxmp's default in bfloat16 (no loss scale): the baseline of the
  float8 variants;
* ``float8``: ``bf16`` with ``matmul_dtype=jnp.float8_e4m3fn`` (one scale per
  tensor); ``mxfp8``: with ``float8_scaling="mxfp8"`` (one per block of 32);
* ``jmp``: jmp's documented float16 recipe, when jmp is installed (the
  ``peers`` extra).

Each (variant, depth, layout) is measured in a process of its own, which first
traces, lowers and compiles the same variant at depth 1 and batch 1 (so that
imports and one-time initialisation are not counted, and no cache keyed by
shapes is warm), then records for the real size:

* ``trace_s``, ``lower_s``, ``compile_s``: CPU time of the process
  (``time.process_time``: every thread, so XLA's compiler threads count; load
  from other processes mostly does not) for ``jax.jit(step).trace``,
  ``.lower()`` and ``.compile()``; ``*_wall_s`` the wall time;
* ``jaxpr_eqns``: equations of the traced step, those of nested jaxprs
  included (a scan body once);
* ``hlo_ops``: instructions of the optimised HLO (fused computations included);
* ``xla_*_bytes``: ``compiled.memory_analysis()`` (``xla_total_bytes``:
  arguments + outputs + temporaries - donated aliases);
* ``step_s``: median wall time of the compiled, donated step (``--steps`` calls
  after one warm-up).

With ``--repeats N`` each measurement runs in N processes; the tables give the
minimum of each CPU time (the least disturbed run) and the median step time.
Ratios are against ``hand_dyn`` at the same depth and layout (float8 and MXFP8
also against ``bf16``); growth exponents are the slope of log(time) against
log(depth) between two depths (``--fit``, default 16 and 64).

Usage::

    python -m benchmarks.scale --out results/scale --depths 4,16,32,64 --repeats 3
    python -m benchmarks.scale --out results/scale-f8 --depths 16 --layouts unrolled \\
        --variants bf16,float8,mxfp8,hand_dyn
    python -m benchmarks.scale --quick --out results/scale-quick   # tiny, seconds

Results accumulate in ``OUT/results.json``: a run with the same ``--out`` reuses
the measurements already there (``--fresh`` discards them).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxmp
from benchmarks import models
from benchmarks import vit

VARIANTS = ("float32", "hand", "hand_dyn", "autocast", "cast", "bf16", "float8", "mxfp8", "jmp")
LAYOUTS = ("unrolled", "scan")
DEFAULT_DEPTHS = (4, 8, 16, 32, 64)
# The tiny decoder of --quick and the tests.
QUICK = models.GPTConfig(vocab=64, seq=16, width=32, depth=1, heads=2, batch=2)
STATIC_SCALE = 2.0**12
# The figures of a measurement: CPU times (the minimum over repeats is reported) and the rest.
TIMES = ("trace_s", "lower_s", "compile_s")


def _hand_static_variant(loss_fn, optimizer, initial_scale, growth_interval) -> vit.Variant:
    """Float16 compute, float32 parameters, a static loss scale: written out by hand."""
    del growth_interval

    def half_loss(params, tokens, labels):
        params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float16), params)
        return loss_fn(params, tokens, labels).astype(jnp.float32)

    def init(params):
        return {"params": params, "opt_state": optimizer.init(params)}

    def grads(state, tokens, labels):
        def scaled(p):
            loss = half_loss(p, tokens, labels)
            return loss * initial_scale, loss

        (_, loss), g = jax.value_and_grad(scaled, has_aux=True)(state["params"])
        return loss, jax.tree_util.tree_map(lambda x: x / initial_scale, g)

    def step(state, tokens, labels):
        loss, g = grads(state, tokens, labels)
        with jax.numpy_dtype_promotion("standard"):  # optax promotes internally
            updates, opt_state = optimizer.update(g, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    return vit.Variant("hand", init, lambda *a: grads(*a)[1], step, half_loss)


def available_variants() -> list[str]:
    """The variants that can run here (``jmp`` only when installed)."""
    return [v for v in VARIANTS if v != "jmp" or vit._installed("jmp")]


def make_variant(name: str, config: models.GPTConfig, scan: bool) -> vit.Variant:
    """The training step ``name`` (see the module docstring) of the decoder ``config``."""
    loss_fn = functools.partial(models.decoder_loss, config=config, scan=scan)
    args = (loss_fn, optax.adam(1e-3), STATIC_SCALE, 2000)
    e4m3 = jnp.float8_e4m3fn
    builders = {
        "float32": lambda: vit._float32_variant(*args),  # pylint: disable=protected-access
        "hand": lambda: _hand_static_variant(*args),
        "hand_dyn": lambda: vit._hand_written_variant(*args),  # pylint: disable=protected-access
        "autocast": lambda: vit._jaxmp_variant(*args, autocast=True),  # pylint: disable=protected-access
        "cast": lambda: vit._jaxmp_variant(*args, autocast=False, name="cast"),  # pylint: disable=protected-access
        "bf16": lambda: vit._jaxmp_variant(  # pylint: disable=protected-access
            *args, autocast=True, compute_dtype=jnp.bfloat16, name="bf16"),
        "float8": lambda: vit._jaxmp_variant(  # pylint: disable=protected-access
            *args, autocast=True, compute_dtype=jnp.bfloat16, matmul_dtype=e4m3, name="float8"),
        "mxfp8": lambda: vit._jaxmp_variant(  # pylint: disable=protected-access
            *args, autocast=True, compute_dtype=jnp.bfloat16, matmul_dtype=e4m3,
            float8_scaling="mxfp8", name="mxfp8"),
        "jmp": lambda: vit._jmp_variant(*args),  # pylint: disable=protected-access
    }
    if name not in builders:
        raise ValueError(f"Unknown variant {name!r}; choose from {VARIANTS}.")
    return builders[name]()


def count_eqns(jaxpr) -> int:
    """Equations of a (closed) jaxpr, those of the jaxprs nested in its equations included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    total += count_eqns(inner)
    return total


def _shapes(config: models.GPTConfig, scan: bool):
    params = jax.eval_shape(functools.partial(models.init_gpt, config=config), jax.random.key(0))
    if scan:
        params = jax.eval_shape(models.stack_blocks, params)
    batch = models.gpt_batch(config)
    return params, batch


def _build(name: str, config: models.GPTConfig, scan: bool):
    variant = make_variant(name, config, scan)
    params, batch = _shapes(config, scan)
    state = jax.eval_shape(variant.init, params)
    return variant, jax.jit(variant.step, donate_argnums=0), state, batch


def measure(name: str, config: models.GPTConfig, layout: str, steps: int = 0) -> dict[str, Any]:
    """Trace, lower, compile (and with ``steps``, run) one step in this process (see above)."""
    scan = layout == "scan"
    # Warm-up: the same variant at depth 1 and batch 1 (other shapes: no shape-keyed cache).
    small = models.GPTConfig(config.vocab, config.seq, config.width, 1, config.heads, 1)
    _, jitted, state, batch = _build(name, small, scan)
    jitted.trace(state, *batch).lower().compile()

    variant, jitted, state, batch = _build(name, config, scan)
    row: dict[str, Any] = {"variant": name, "depth": config.depth, "layout": layout}
    clock = (time.process_time(), time.perf_counter())

    def lap(key):
        nonlocal clock
        now = (time.process_time(), time.perf_counter())
        row[key], row[key.replace("_s", "_wall_s")] = now[0] - clock[0], now[1] - clock[1]
        clock = now

    traced = jitted.trace(state, *batch)
    lap("trace_s")
    lowered = traced.lower()
    lap("lower_s")
    compiled = lowered.compile()
    lap("compile_s")
    row["jaxpr_eqns"] = count_eqns(traced.jaxpr)
    row["hlo_ops"] = vit.count_hlo_ops(compiled.as_text())
    row.update(vit.xla_memory(compiled))
    if steps:
        params = models.init_gpt(jax.random.key(0), config)
        if scan:
            params = models.stack_blocks(params)
        tokens = jax.random.randint(jax.random.key(1), batch[0].shape, 0, config.vocab, jnp.int32)
        labels = jnp.roll(tokens, -1, axis=1)
        row["step_s"], loss = _median_step(compiled, variant.init(params), tokens, labels, steps)
        row["loss"] = float(loss)
    return row


def _median_step(compiled, live, tokens, labels, steps: int) -> tuple[float, Any]:
    """The median wall time of ``steps`` calls of ``compiled`` after one warm-up call, and the
    last loss (the state is donated from call to call)."""
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        live, loss = compiled(live, tokens, labels)
        jax.block_until_ready((live, loss))
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times), loss


def measure_nonfinite(config: models.GPTConfig, layout: str, steps: int = 3) -> dict[str, Any]:
    """``jaxmp.debug.find_nonfinite`` on the float16 decoder against one plain step, in this process.

    The plain step is jaxmp's default float16 step (``autocast``), compiled
    first, its median over ``steps`` calls; the diagnosis is timed from the
    call to the report, its compilation included (a diagnosis runs once).
    """
    scan = layout == "scan"
    params = models.init_gpt(jax.random.key(0), config)
    if scan:
        params = models.stack_blocks(params)
    tokens = jax.random.randint(jax.random.key(1), (config.batch, config.seq), 0, config.vocab,
                                jnp.int32)
    labels = jnp.roll(tokens, -1, axis=1)
    variant = make_variant("autocast", config, scan)
    compiled = jax.jit(variant.step, donate_argnums=0).lower(
        jax.eval_shape(variant.init, params), tokens, labels).compile()
    step, _ = _median_step(compiled, variant.init(jax.tree_util.tree_map(jnp.copy, params)),
                           tokens, labels, steps)
    del compiled
    loss_fn = functools.partial(models.decoder_loss, config=config, scan=scan)
    find = jaxmp.debug.find_nonfinite(loss_fn, compute_dtype=jnp.float16)
    start, cpu = time.perf_counter(), time.process_time()
    report = find(params, tokens, labels)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"variant": "find_nonfinite", "depth": config.depth, "layout": layout,
            "step_s": step, "diagnosis_s": seconds, "diagnosis_cpu_s": cpu,
            "steps": seconds / step, "findings": len(report.findings),
            "overflows": sum(f.kind == "overflow" for f in report.findings),
            "loss": report.loss, "loss_float32": report.loss_float32,
            "report": str(report)}


def _key(row) -> str:
    return f"{row['layout']}/{row['depth']}/{row['variant']}"


def run_child(name: str, depth: int, layout: str, quick: bool, steps: int,
              timeout: float | None = None) -> dict[str, Any]:
    """``measure`` in a fresh process; its row, or ``{"error": ...}``."""
    cmd = [sys.executable, "-m", "benchmarks.scale", "--child", f"{name},{depth},{layout}",
           "--steps", str(steps)] + (["--quick"] if quick else [])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"variant": name, "depth": depth, "layout": layout,
                "error": f"did not finish in {timeout:.0f} s"}
    lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"variant": name, "depth": depth, "layout": layout,
                "error": " | ".join(tail) or f"exit code {done.returncode}"}
    return json.loads(lines[-1])


def summarise(runs: list[dict]) -> dict[str, Any]:
    """One row per measurement: the minimum of each CPU time over its runs, the median step."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return dict(runs[-1])
    row = dict(ok[0])
    for key in (k for k in TIMES if k in row):
        row[key] = min(r[key] for r in ok)
        row[key.replace("_s", "_wall_s")] = min(r[key.replace("_s", "_wall_s")] for r in ok)
    steps = [r["step_s"] for r in ok if r.get("step_s") is not None]
    row["step_s"] = statistics.median(steps) if steps else None
    row["runs"] = len(ok)
    return row


def exponent(rows: dict[str, dict], layout: str, variant: str, key: str, lo: int, hi: int):
    """The slope of log(``key``) against log(depth) from depth ``lo`` to ``hi``, or ``None``."""
    a, b = rows.get(f"{layout}/{lo}/{variant}"), rows.get(f"{layout}/{hi}/{variant}")
    if not a or not b or not a.get(key) or not b.get(key):
        return None
    return math.log(b[key] / a[key]) / math.log(hi / lo)


def _fmt(value, spec=".2f", suffix=""):
    return "n/a" if value is None else format(value, spec) + suffix


def _ratio(row, base, key):
    if not row or not base or not row.get(key) or not base.get(key):
        return None
    return row[key] / base[key]


def tables(results: dict[str, Any], fit: tuple[int, int]) -> str:
    """The Markdown tables of a run: per layout and depth, then the float8 programs, then growth."""
    rows = {_key(r): r for r in results["rows"]}
    layouts = [l for l in LAYOUTS if any(r["layout"] == l for r in rows.values())]
    depths = sorted({r["depth"] for r in rows.values()})
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows.values())]
    out = []
    for layout in layouts:
        out += [f"\n### {layout}\n",
                "| depth | variant | trace s | vs hand_dyn | lower s | compile s | vs hand_dyn "
                "| jaxpr eqns | HLO instr. | vs hand_dyn | XLA MiB | vs hand_dyn | step s | vs hand_dyn |",
                "|" + "---|" * 14]
        for depth in depths:
            base = rows.get(f"{layout}/{depth}/hand_dyn")
            for v in variants:
                r = rows.get(f"{layout}/{depth}/{v}")
                if r is None:
                    continue
                if "error" in r:
                    out.append(f"| {depth} | {v} | {r['error'][:80]} |" + " |" * 12)
                    continue
                mib = r.get("xla_total_bytes") and r["xla_total_bytes"] / 2**20
                out.append(
                    f"| {depth} | {v} | {r['trace_s']:.2f} | {_fmt(_ratio(r, base, 'trace_s'), '.2f', 'x')} "
                    f"| {r['lower_s']:.2f} | {r['compile_s']:.2f} "
                    f"| {_fmt(_ratio(r, base, 'compile_s'), '.2f', 'x')} | {r['jaxpr_eqns']} "
                    f"| {r['hlo_ops']} | {_fmt(_ratio(r, base, 'hlo_ops'), '.2f', 'x')} "
                    f"| {_fmt(mib, '.1f')} | {_fmt(_ratio(r, base, 'xla_total_bytes'), '.3f', 'x')} "
                    f"| {_fmt(r.get('step_s'), '.3f')} | {_fmt(_ratio(r, base, 'step_s'), '.2f', 'x')} |")
    if any(v in variants for v in ("float8", "mxfp8")):
        out += ["\n### float8 programs against their bfloat16 step\n",
                "| layout | depth | variant | HLO vs bf16 | compile vs bf16 | trace vs bf16 | XLA memory vs bf16 |",
                "|" + "---|" * 7]
        for layout in layouts:
            for depth in depths:
                base = rows.get(f"{layout}/{depth}/bf16")
                for v in ("float8", "mxfp8"):
                    r = rows.get(f"{layout}/{depth}/{v}")
                    if r is None or base is None or "error" in r:
                        continue
                    out.append(f"| {layout} | {depth} | {v} | {_fmt(_ratio(r, base, 'hlo_ops'), '.2f', 'x')} "
                               f"| {_fmt(_ratio(r, base, 'compile_s'), '.2f', 'x')} "
                               f"| {_fmt(_ratio(r, base, 'trace_s'), '.2f', 'x')} "
                               f"| {_fmt(_ratio(r, base, 'xla_total_bytes'), '.3f', 'x')} |")
    diagnoses = [r for r in rows.values() if r["variant"] == "find_nonfinite"]
    if diagnoses:
        out += ["\n### find_nonfinite (float16) against one plain step\n",
                "| layout | depth | plain step s | diagnosis s (CPU s) | in steps | findings (overflows) "
                "| loss float16 / float32 shadow |", "|" + "---|" * 7]
        for r in sorted(diagnoses, key=lambda r: (r["layout"], r["depth"])):
            if "error" in r:
                out.append(f"| {r['layout']} | {r['depth']} | {r['error'][:80]} |" + " |" * 4)
                continue
            out.append(f"| {r['layout']} | {r['depth']} | {r['step_s']:.3f} | {r['diagnosis_s']:.1f} "
                       f"({r['diagnosis_cpu_s']:.1f}) | {r['steps']:.1f} | {r['findings']} ({r['overflows']}) "
                       f"| {r['loss']:.5f} / {r['loss_float32']:.5f} |")
    lo, hi = fit
    out += [f"\n### Growth exponents from depth {lo} to {hi} (time ~ depth^k)\n",
            "| layout | variant | trace | lower | compile | jaxpr eqns | HLO instr. |", "|" + "---|" * 7]
    for layout in layouts:
        for v in variants:
            ks = [exponent(rows, layout, v, key, lo, hi)
                  for key in ("trace_s", "lower_s", "compile_s", "jaxpr_eqns", "hlo_ops")]
            if any(k is not None for k in ks):
                out.append(f"| {layout} | {v} | " + " | ".join(_fmt(k) for k in ks) + " |")
    return "\n".join(out)


def _parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(",") if t.strip())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for results.json (required but for --child)")
    parser.add_argument("--depths", default=None, help="comma-separated (default 4,8,16,32,64)")
    parser.add_argument("--layouts", default="unrolled,scan")
    parser.add_argument("--variants", default=None, help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=1, help="processes per measurement")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per process (0: none)")
    parser.add_argument("--fit", default="16,64", help="the two depths of the growth exponents")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per process")
    parser.add_argument("--quick", action="store_true",
                        help="the tiny decoder (width 32, sequence 16), depths 1 and 2, no timed steps")
    parser.add_argument("--nonfinite", default="",
                        help="comma-separated depths at which to time jaxmp.debug.find_nonfinite "
                             "(float16, each layout of --layouts) against one plain step")
    parser.add_argument("--fresh", action="store_true", help="ignore the results already in --out")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = QUICK if args.quick else models.DECODER

    if args.child:
        name, depth, layout = args.child.split(",")
        sized = models.GPTConfig(config.vocab, config.seq, config.width, int(depth),
                                 config.heads, config.batch)
        if name == "find_nonfinite":
            row = measure_nonfinite(sized, layout, max(args.steps, 1))
        else:
            row = measure(name, sized, layout, args.steps)
        print(json.dumps(row), flush=True)
        return 0

    if not args.out:
        parser.error("--out is required")
    depths = _parse_ints(args.depths) if args.depths else ((1, 2) if args.quick else DEFAULT_DEPTHS)
    steps = 0 if args.quick else args.steps
    layouts = [l for l in args.layouts.split(",") if l]
    if [l for l in layouts if l not in LAYOUTS]:
        parser.error(f"unknown layout in {layouts}; choose from {LAYOUTS}")
    names = available_variants()
    skipped = {} if "jmp" in names else {"jmp": "not installed (pip install jaxmp[peers])"}
    if args.variants:
        wanted = args.variants.split(",")
        unknown = [v for v in wanted if v not in VARIANTS]
        if unknown:
            parser.error(f"unknown variant(s) {unknown}; choose from {VARIANTS}")
        names = [v for v in names if v in wanted]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "results.json")
    results: dict[str, Any] = {"runs": {}}
    if os.path.exists(path) and not args.fresh:
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
    results["machine"] = vit.machine_info()
    results["config"] = {"vocab": config.vocab, "seq": config.seq, "width": config.width,
                         "heads": config.heads, "batch": config.batch}
    results.setdefault("commands", []).append(
        " ".join(["python -m benchmarks.scale"] + list(sys.argv[1:] if argv is None else argv)))
    results["skipped"] = skipped
    for layout in layouts:
        for depth in depths:
            for name in names:
                key = f"{layout}/{depth}/{name}"
                runs = results["runs"].setdefault(key, [])
                while len([r for r in runs if "error" not in r]) < args.repeats:
                    row = run_child(name, depth, layout, args.quick, steps, args.timeout)
                    runs.append(row)
                    print(f"{key}: " + (row.get("error") or
                                        f"trace {row['trace_s']:.2f} s, compile {row['compile_s']:.2f} s, "
                                        f"{row['hlo_ops']} HLO"), flush=True)
                    with open(path, "w", encoding="utf-8") as f:
                        json.dump(results, f, indent=1)
                    if "error" in row:
                        break
    for layout in layouts:
        for depth in _parse_ints(args.nonfinite):
            key = f"{layout}/{depth}/find_nonfinite"
            runs = results["runs"].setdefault(key, [])
            if not [r for r in runs if "error" not in r]:
                row = run_child("find_nonfinite", depth, layout, args.quick, max(steps, 2),
                                args.timeout)
                runs.append(row)
                print(f"{key}: " + (row.get("error") or f"{row['diagnosis_s']:.1f} s = "
                                    f"{row['steps']:.1f} steps, {row['findings']} findings"),
                      flush=True)
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(results, f, indent=1)
    results["rows"] = [summarise(runs) for runs in results["runs"].values() if runs]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    lo, hi = _parse_ints(args.fit)
    print(tables(results, (lo, hi)))
    if skipped:
        print("\nSkipped: " + ", ".join(f"{k} ({v})" for k, v in skipped.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
