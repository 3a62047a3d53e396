"""`ddplab collectives` and `ddplab bench comm` on real gloo processes.

Expected values are computed here from the rank formulas, not taken from the tool's output."""

import json

import pytest

from ddplab.experiments.collectives_tour import DEMOS
from helpers import ddplab, ddplab_here

pytestmark = pytest.mark.timeout(60)
W = 3


def t(r, n=3):
    return [float(10 * r + i) for i in range(n)]


def expected_after(op, r):
    """What rank r must hold after each primitive, with W ranks (None: undefined on that rank)."""
    plus1 = [[x + 1 for x in t(q)] for q in range(W)]
    ints = [[10 * q + i + 1 for i in range(3)] for q in range(W)]

    def fold(f, rows):
        out = list(rows[0])
        for row in rows[1:]:
            out = [f(a, b) for a, b in zip(out, row, strict=True)]
        return out

    table = {
        "send_recv": t(r - 1) if r % 2 else t(r),
        "isend_irecv": t((r - 1) % W),
        "broadcast": t(0),
        "broadcast_object_list": [{"from rank": 0}],
        "scatter": [10.0 * r] * 2,
        "scatter_object_list": f"for rank {r}",
        "gather": [t(q, 2) for q in range(W)] if r == 0 else None,
        "gather_object": [{"rank": q, "squared": q * q} for q in range(W)] if r == 0 else None,
        "reduce_sum": fold(lambda a, b: a + b, plus1),
        "reduce_product": fold(lambda a, b: a * b, plus1),
        "reduce_min": fold(min, plus1),
        "reduce_max": fold(max, plus1),
        "reduce_band": fold(lambda a, b: a & b, ints),
        "reduce_bor": fold(lambda a, b: a | b, ints),
        "reduce_bxor": fold(lambda a, b: a ^ b, ints),
        "reduce_avg": [x / W for x in fold(lambda a, b: a + b, plus1)],
        "reduce_scatter": [float(sum(10 * q + r for q in range(W)))] * 2,
        "all_gather": [t(q, 2) for q in range(W)],
        "all_gather_object": [f"hello from rank {q}" for q in range(W)],
        "all_reduce": fold(lambda a, b: a + b, [t(q) for q in range(W)]),
        "all_to_all": [[float(10 * q + r)] for q in range(W)],
        "barrier": "passed",
        "monitored_barrier": "passed",
    }
    if op.startswith("reduce_") and op != "reduce_scatter" and r != 0:
        return None
    return table[op]


@pytest.mark.slow
def test_every_primitive_per_rank(tmp_path):
    out = tmp_path / "tour.json"
    res = ddplab_here("collectives", "-n", str(W), "--json", str(out))
    assert res.returncode == 0, res.stderr
    report = json.loads(out.read_text())
    assert report["backend"] == "gloo" and report["world_size"] == W
    by_op = {rec["op"]: [report["ranks"][r][i] for r in range(W)] for i, rec in enumerate(report["ranks"][0])}
    # gloo refuses exactly this one (PREMUL_SUM is NCCL's); every other primitive must run and give
    # the value the formulas say, on every rank.
    refused = {op for op, recs in by_op.items() if any(rec["status"] != "ok" for rec in recs)}
    assert refused == {"all_reduce_premul_sum"}
    checked = 0
    for op, recs in by_op.items():
        if op in refused or op == "variable_mean":
            continue
        for r, rec in enumerate(recs):
            want = expected_after(op, r)
            got = rec["after"]
            if isinstance(want, list) and want and isinstance(want[0], float):
                assert got == pytest.approx(want), (op, r)
            else:
                assert got == want, (op, r, got, want)
        checked += 1
    # all but the refused one and variable_mean (below)
    assert checked == len(by_op) - len(refused) - 1
    # A mean over different lengths: ranks hold 1, 2, 3 values.
    values = [0.0, 10.0, 11.0, 20.0, 21.0, 22.0]
    mean = by_op["variable_mean"][0]["after"]
    assert mean["gathered"] == values and mean["true mean"] == pytest.approx(sum(values) / 6)
    assert mean["mean of rank means"] == pytest.approx((0.0 + 10.5 + 21.0) / 3)
    # Printed in rank order, one block per primitive.
    text = res.stdout
    assert text.index("== all_reduce ") < text.index("== all_to_all ")
    assert text.index("rank 0  before") < text.index("rank 1  before") < text.index("rank 2  before")


def test_unsupported_primitive_is_one_line_and_the_tour_goes_on(tmp_path):
    res = ddplab_here("collectives", "all_reduce_premul_sum", "all_reduce", "-n", "2")
    assert res.returncode == 0, res.stderr
    assert "not supported by gloo: Cannot use ReduceOp.PREMUL_SUM with Gloo" in res.stdout
    block = res.stdout.split("== all_reduce ")[1]
    assert "rank 1  before [10.0, 11.0, 12.0]" in block and "after [10.0, 12.0, 14.0]" in block


def test_the_help_lists_every_primitive_it_promises():
    res = ddplab("collectives", "--help")
    assert res.returncode == 0 and "see the list below" in res.stdout
    listed = res.stdout.split("primitives:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in listed if line.strip()] == list(DEMOS), res.stdout


def test_unknown_primitive_is_rejected_before_starting():
    res = ddplab_here("collectives", "all_reduse")
    assert res.returncode == 2 and "unknown primitive(s) ['all_reduse']" in res.stderr


@pytest.mark.slow
def test_comm_bench_json_fields(tmp_path):
    out = tmp_path / "bench.json"
    res = ddplab_here("bench", "comm", "-n", "2", "--sizes", "8,4K", "--iters", "3", "--json", str(out))
    assert res.returncode == 0, res.stderr
    report = json.loads(out.read_text())
    assert {"backend", "world_size", "device", "formulas", "results"} <= set(report)
    rows = report["results"]
    assert {(r["op"], r["bytes"]) for r in rows} == {
        (op, size) for op in ("all_reduce", "all_gather", "broadcast", "reduce_scatter") for size in (8, 4096)
    }
    factor = {"all_reduce": 2 * (2 - 1) / 2, "all_gather": 1 / 2, "reduce_scatter": 1 / 2, "broadcast": 1.0}
    for row in rows:
        assert row["status"] == "ok" and row["iters"] == 3 and row["time_us"] > 0
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factor[row["op"]])
    assert "algbw (GB/s)" in res.stdout and "busbw (GB/s)" in res.stdout


@pytest.mark.slow
@pytest.mark.parametrize("command", [["collectives", "all_reduce"], ["bench", "comm", "--sizes", "8"]])
def test_a_json_file_that_cannot_be_written_is_refused_before_anything_runs(tmp_path, command):
    """The measurement would be lost after it ran: a folder, or a folder that does not exist."""
    for target, message in ((tmp_path, "is a folder"), (tmp_path / "missing" / "out.json", "cannot write in")):
        res = ddplab_here(*command, "-n", "2", "--json", str(target))
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.returncode == 2 and len(lines) == 1 and message in lines[0], res.stdout + res.stderr
        assert "all_reduce" not in res.stdout
