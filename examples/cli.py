"""The command line every example shares, and the side-by-side table they print.

Every example takes ``--precision`` with one or several of ``float32``,
``float16`` and ``bfloat16`` (trained one after the other, from the same
initial weights and batches) and prints one table with a column per precision.
``--help`` lists every flag with its default.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

PRECISIONS = ("float32", "float16", "bfloat16")

# The flags an example may offer, with their help text; each example picks its
# own defaults (and so its own flags) in parse_args.
HELP = {
    "steps": "training steps",
    "batch_size": "examples per step",
    "learning_rate": "peak learning rate (cosine decay to 0)",
    "seed": "seed of the initial weights and the batch order",
    "width": "channels of the first convolution",
    "log_every": "steps between two updates of the progress bar",
    "chunk": "steps per jitted lax.scan call (the progress bar moves once per chunk)",
    "patch": "side of the square image patches",
    "dim": "width of the transformer",
    "depth": "number of transformer blocks",
    "heads": "attention heads",
    "mlp_dim": "hidden width of each block's MLP",
    "growth_interval": "float16: finite steps between two growths of the loss scale",
    "out": "directory for the plot and the table",
}


def parse_args(description: str, argv: Sequence[str] | None = None, *,
               precision: Sequence[str] = ("float16",), **defaults: Any) -> argparse.Namespace:
    """Parses ``--precision`` and one flag per keyword of ``defaults``.

    Args:
        description: shown by ``--help``; the first line of a module docstring
            is enough, so an example passes its ``__doc__``.
        argv: the arguments; ``None`` reads ``sys.argv``.
        precision: the default precisions.
        **defaults: flag name (``batch_size`` becomes ``--batch-size``) and
            default value; the value's type is the flag's type.

    Returns:
        The parsed flags; ``precision`` is a list.
    """
    spec = getattr(sys.modules["__main__"], "__spec__", None)  # set by python -m
    parser = argparse.ArgumentParser(prog=f"python -m {spec.name}" if spec else None,
                                     description=description.strip().splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS, default=list(precision),
                        help="one or several, trained one after the other and shown side by side")
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                            help=HELP[name])
    return parser.parse_args(argv)


def table(columns: Sequence[str], rows: Sequence[tuple[str, Sequence[str]]]) -> str:
    """A text table: one column per precision, one row per measure.

    Columns are 18 characters wide and right-aligned, so cells stay at least
    two spaces apart (a cell may hold single spaces: ``"2.03 ms (1.2 s)"``).
    """
    width = max(len(label) for label, _ in rows)
    lines = [" " * width + "".join(f"{c:>18}" for c in columns)]
    lines += [label.ljust(width) + "".join(f"{v:>18}" for v in values) for label, values in rows]
    return "\n".join(lines)
