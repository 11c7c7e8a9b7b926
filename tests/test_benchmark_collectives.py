"""The collectives benchmark: its HLO parser, and a small run that shows what reduce_dtype changes."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import collectives

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_count_collectives_reads_tuples_groups_and_scatter_inputs():
    hlo = "\n".join([
        "  %all-reduce = (f32[5,8]{1,0}, f32[8]{0}) all-reduce(%a, %b), replica_groups={{0,1,2,3}}",
        "  %rs = f16[2,8]{1,0} reduce-scatter(%c), replica_groups=[1,4]<=[4], dimensions={0}",
        "  %ag = f16[8,8]{1,0} all-gather-start(%d), replica_groups={{0,1},{2,3}}",
        "  %x = f32[8,8]{1,0} add(%e, %f)",
    ])
    got = collectives.count_collectives(hlo, devices=4)
    assert got["all-reduce f32"] == {"buffers": 2, "elements": 48, "payload_bytes": 192,
                                     "ring_bytes": 288}
    # A reduce-scatter moves its (4 x larger) input; an all-gather its output, here over 2 devices.
    assert got["reduce-scatter f16"]["payload_bytes"] == 2 * 8 * 2 * 4
    assert got["all-gather f16"] == {"buffers": 1, "elements": 64, "payload_bytes": 128,
                                     "ring_bytes": 64}
    assert set(got) == {"all-reduce f32", "reduce-scatter f16", "all-gather f16"}


@pytest.mark.slow  # an end-to-end run of the script: every mode, both paths, compiled
def test_small_run_shows_float32_reductions_at_twice_the_bytes(tmp_path):
    subprocess.run([sys.executable, "-m", "benchmarks.collectives", "--out", str(tmp_path),
                    "--width", "16", "--depth", "2", "--batch", "8"],
                   cwd=ROOT, check=True, timeout=240, capture_output=True)
    results = json.loads((tmp_path / "collectives.json").read_text())["results"]
    rows = {(r["mode"], r["reduce_dtype"]): r["compiled"] for r in results
            if r["path"] in ("cast", "-")}
    default = {(r["mode"], r["reduce_dtype"]): r["compiled"] for r in results
               if r["path"] == "default"}
    before, after = rows[("jit_dp", "none")], rows[("jit_dp", "float32")]
    assert before["all-reduce f16"]["buffers"] == 3  # one per weight matrix (depth 2 + output), float16
    assert "all-reduce f16" not in after
    weights_f32 = after["all-reduce f32"]["payload_bytes"] - before["all-reduce f32"]["payload_bytes"]
    assert weights_f32 == 2 * before["all-reduce f16"]["payload_bytes"]
    fsdp = rows[("shard_map_fsdp", "float32")]
    assert "reduce-scatter f32" in fsdp and "reduce-scatter f16" not in fsdp
    assert "reduce-scatter f16" in rows[("shard_map_fsdp", "none")]
    # The default moves no more than the cast path, per collective kind (float16 compute).
    for key, cast in rows.items():
        if key in default:
            got, want = collectives.bytes_by_kind(default[key]), collectives.bytes_by_kind(cast)
            for kind, moved in got.items():
                assert moved <= 1.02 * want.get(kind, 0), (key, kind, got, want)
