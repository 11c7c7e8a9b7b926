"""benchmarks/float8_conv.py: a conv net's whole training step in float8, and the script's run."""

import json

import numpy as np
import pytest

from benchmarks import float8_conv as bench


@pytest.mark.slow  # an end-to-end run of the script's shares and a few training steps
def test_shares_and_a_short_training_run(tmp_path):
    """The Equinox conv net (a function leaf, GroupNorm) runs every forward product of its
    step in float8 and the rest in bfloat16 (XLA runs only forward convolutions in float8: the
    kernel gradients and strided input gradients run in bfloat16, nothing in float32), and the
    script writes its figures; a few float8 steps lower the loss."""
    results = bench.main(["--out", str(tmp_path), "--no-train", "--models", "equinox_convnet",
                          "--batch-size", "16"])
    rows = results["shares"]["equinox_convnet"]
    assert rows["float8"]["float8_share_forward"] == 1.0
    assert 0 < rows["float8"]["float8_share_backward"] < 1
    assert rows["float8"]["low_precision_share_step"] == 1.0
    assert rows["bfloat16"]["float8_share_step"] == 0.0
    assert rows["bfloat16"]["low_precision_share_step"] == 1.0
    assert rows["float32"]["low_precision_share_step"] == 0.0
    assert json.loads((tmp_path / "results.json").read_text())["shares"]
    assert "equinox_convnet | 100.0% | " in (tmp_path / "results.md").read_text()

    data, (tx, ty) = bench.digits_batches(6, 16, upsample=2)
    run = bench.train(bench.equinox_convnet(0, data[0][0]), "float8", data, [(tx[:32], ty[:32])],
                      learning_rate=3e-3)
    assert run["nonfinite_losses"] == 0
    assert run["final_train_loss"] < run["first_loss"]
    assert np.isfinite(run["test_loss_float32"])
