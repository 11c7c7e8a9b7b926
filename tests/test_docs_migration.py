"""The table from MPX's and jmp's API to jaxmp's (docs/migration.md) names things that exist.

Its jaxmp column must name public jaxmp functions; the MPX and jmp columns are
checked against the installed peer libraries when they are there (the
``peers`` extra). The code block after the table runs in tests/test_docs.py.
"""

import pathlib
import re

import jax.numpy as jnp
import pytest

import jaxmp

PAGE = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "migration.md").read_text()
SECTION = PAGE.split("# Coming from MPX or jmp", 1)[1].split("\n## ", 1)[0]
TABLE = [[cell.strip() for cell in line.strip()[1:-1].split("|")]
         for line in SECTION.splitlines() if line.startswith("|") and "---" not in line][1:]


def _names(column, prefix):
    return sorted({m for row in TABLE for m in re.findall(rf"\b{prefix}\.(\w+)", row[column])})


def test_table_has_three_columns_and_the_issue_rows():
    assert TABLE and all(len(row) == 3 for row in TABLE)
    for needed in ("filter_value_and_grad", "DynamicLossScaling", ".loss_scaling",
                   "optimizer_update", "select_tree", "get_policy"):
        assert any(needed in " ".join(row) for row in TABLE), needed


def test_jaxmp_column_names_public_functions():
    names = _names(2, "jaxmp")
    assert len(names) >= 15
    for name in names:
        assert name in jaxmp.__all__, name


@pytest.mark.parametrize("column, module", [(0, "mpx"), (1, "jmp")])
def test_peer_columns_name_what_the_peers_have(column, module):
    peer = pytest.importorskip(module)  # optional peer libraries ("peers" extra)
    names = _names(column, module)
    assert names
    for name in names:
        assert hasattr(peer, name), f"{module}.{name}"
    # The attributes and methods named after an instance.
    if module == "mpx":
        state = peer.DynamicLossScaling(jnp.asarray(2.0**15), jnp.asarray(1.0))
    else:
        state = peer.DynamicLossScale(jnp.asarray(2.0**15))
    for attribute in ("counter", "scale", "unscale", "adjust"):
        assert hasattr(state, attribute)
    assert hasattr(state, "loss_scaling" if module == "mpx" else "loss_scale")
