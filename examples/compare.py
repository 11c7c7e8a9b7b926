"""Trains the same Vision Transformer in float32 and in mixed precision, side by side.

    python -m examples.compare [--out DIR] [--precision ...]

(from the repository root). The model and the training step are those of
``examples/equinox/train.py`` (an Equinox ViT on scikit-learn's digits, nothing
to download), and so are the flags. Each precision trains from the same
initial weights on the same batches; the script prints a comparison table and
writes ``DIR/compare.png`` (loss curves and loss-scale trajectory) and
``DIR/compare.txt`` (the table).
"""

from __future__ import annotations

import os
import time
from typing import Sequence

_start = time.perf_counter()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxmp  # noqa: E402
from examples import cli  # noqa: E402
from examples.equinox import train as vit_example  # noqa: E402


def saved_activation_bytes(precision: str, config: vit_example.Config) -> int:
    """Bytes the training step keeps for its backward pass, for one batch.

    ``mp_value_and_grad`` differentiates the loss under ``jaxmp.autocast`` (its
    default); the same is done here, and ``jaxmp.debug.saved_activation_bytes`` sums
    the residuals of that VJP with ``jax.eval_shape`` (nothing runs, so the
    figure is the same on any backend).
    """
    params, static, _ = vit_example.build(config)
    model = eqx.combine(params, static)
    images = np.zeros((config.batch_size, 8, 8, 1), np.float32)
    labels = np.zeros((config.batch_size,), np.int32)
    loss_fn = vit_example.loss_fn
    if precision != "float32":
        loss_fn = jaxmp.autocast(loss_fn, vit_example.DTYPES[precision])
    return jaxmp.debug.saved_activation_bytes(loss_fn, model, images, labels)


def table(results, memory, config) -> str:
    """The Equinox example's table, with the saved-activation memory after the times."""
    names = [r.precision for r in results]
    rows = vit_example.rows(results, config)
    rows[3:3] = [
        ("saved activations per step (KiB)", [f"{memory[n] / 1024:.1f}" for n in names]),
        ("saved activations, float32 / this", [f"{memory['float32'] / memory[n]:.2f}x"
                                               if "float32" in memory else "-" for n in names]),
    ]
    return cli.table(names, rows)


def plot(results, path: str, smooth: int) -> None:
    import matplotlib  # imported here: not needed by --help

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 4))
    unscaled = []
    for r in results:
        kernel = np.ones(smooth) / smooth
        steps = np.arange(len(r.losses))
        ax_loss.plot(steps[smooth - 1:], np.convolve(r.losses, kernel, mode="valid"),
                     label=r.precision)
        if np.all(r.scales == 1.0) and np.all(r.finite):
            unscaled.append(r.precision)
            continue
        line, = ax_scale.plot(steps, r.scales, label=r.precision, drawstyle="steps-post")
        skipped = np.flatnonzero(~r.finite)
        if skipped.size:
            ax_scale.plot(skipped, r.scales[skipped], "x", color=line.get_color(), markersize=9,
                          label=f"{r.precision}: skipped step (non-finite gradients)")
    ax_loss.set(yscale="log", xlabel="step", ylabel=f"training loss (mean of {smooth} steps)",
                title="Training loss")
    ax_scale.set(xlabel="step", ylabel="loss scale used by the step",
                 title="Dynamic loss scale" + (f" ({' and '.join(unscaled)}: no scaling)"
                                               if unscaled else ""))
    ax_scale.set_yscale("log", base=2)
    for ax in (ax_loss, ax_scale):
        if ax.has_data():
            ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    args, config = vit_example.parse_args(__doc__, argv, precision=cli.PRECISIONS, out="out")
    precisions = args.precision

    print(f"Equinox ViT on the digits data: {config.steps} steps of batch {config.batch_size}, "
          f"dim {config.dim}, depth {config.depth}, patches {config.patch}x{config.patch}")
    results = []
    for precision in precisions:
        result = vit_example.train(precision, config)
        print(f"  {precision}: done, {1000 * result.seconds_per_step:.2f} ms/step, "
              f"{result.compile_seconds:.1f} s compilation")
        results.append(result)
    memory = {p: saved_activation_bytes(p, config) for p in precisions}

    text = table(results, memory, config)
    print()
    print(text)
    if "float32" in precisions:
        reference = results[precisions.index("float32")].accuracy
        for r in results:
            if r.precision != "float32":
                gap = 100 * (r.accuracy - reference)
                print(f"{r.precision} accuracy vs float32: {gap:+.2f} percentage points")
    if jax.default_backend() == "cpu":
        print("Time per step is measured on this CPU, which has no fast half-precision "
              "arithmetic;\nthe saved-activation memory does not depend on the backend.")

    os.makedirs(args.out, exist_ok=True)
    figure = os.path.join(args.out, "compare.png")
    plot(results, figure, smooth=min(20, config.steps))
    with open(os.path.join(args.out, "compare.txt"), "w") as f:
        f.write(text + "\n")
    print(f"Wrote {figure} and {os.path.join(args.out, 'compare.txt')} "
          f"({time.perf_counter() - _start:.0f} s in all).")


if __name__ == "__main__":
    main()
