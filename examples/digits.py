"""The data every example trains on: scikit-learn's handwritten digits.

1,797 grayscale 8x8 images of the digits 0-9, shipped inside scikit-learn, so
nothing is downloaded. The split is fixed (seeded), so runs are comparable.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import numpy as np


class Split(NamedTuple):
    images: np.ndarray  # float32, [N, 8, 8, 1], scaled to [0, 1]
    labels: np.ndarray  # int32, [N]


def load(test_fraction: float = 0.2, seed: int = 0) -> tuple[Split, Split]:
    """Returns the (train, test) splits of the digits data set."""
    from sklearn.datasets import load_digits  # imported here: a second or two, not needed by --help

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    n_test = int(round(test_fraction * len(labels)))
    test, train = order[:n_test], order[n_test:]
    return Split(images[train], labels[train]), Split(images[test], labels[test])


def epoch_batches(split: Split, batch_size: int, num_steps: int, seed: int = 0) -> Split:
    """Stacks ``num_steps`` shuffled batches into arrays of shape [num_steps, batch, ...].

    Stacked batches are what a training loop written as ``jax.lax.scan`` over
    steps consumes. Each pass over the data is reshuffled; incomplete batches
    are dropped.
    """
    rng = np.random.default_rng(seed)
    per_epoch = len(split.labels) // batch_size
    if per_epoch == 0:
        raise ValueError(f"batch_size {batch_size} exceeds the split size {len(split.labels)}.")
    idx = []
    while len(idx) < num_steps:
        order = rng.permutation(len(split.labels))
        idx.extend(order[i * batch_size:(i + 1) * batch_size] for i in range(per_epoch))
    idx = np.stack(idx[:num_steps])
    return Split(split.images[idx], split.labels[idx])


def batches(split: Split, batch_size: int, num_steps: int, seed: int = 0) -> Iterator[Split]:
    """Yields ``num_steps`` shuffled batches, for a jitted step in a Python loop."""
    stacked = epoch_batches(split, batch_size, num_steps, seed)
    for i in range(num_steps):
        yield Split(stacked.images[i], stacked.labels[i])

