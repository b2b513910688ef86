"""Every collective and dtype, odd counts, in-place and out-of-place, against the reference."""

import time

import pytest

from conftest import assert_all_pass, run_ranks

FLOAT_DTYPES = ["f32", "f64", "f16", "bf16"]
INT_DTYPES = ["i8", "u8", "i32", "i64"]
DTYPES = FLOAT_DTYPES + INT_DTYPES
# Arithmetic reductions: every dtype. Bitwise reductions: integer dtypes only (tests below).
REDOPS = ["sum", "prod", "min", "max", "avg"]
BITWISE_REDOPS = ["band", "bor", "bxor"]
REDUCING = ["all_reduce", "reduce", "reduce_scatter"]
COLLECTIVES = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all"]


def steps_for(nranks, count):
    steps = []
    seed = 1
    for dt in DTYPES:
        for op in COLLECTIVES:
            redops = REDOPS if op in ("all_reduce", "reduce", "reduce_scatter") else [None]
            for redop in redops:
                for inplace in (False, True):
                    seed += 1
                    s = {"op": op, "dtype": dt, "count": count, "inplace": inplace, "seed": seed,
                         "root": seed % nranks}
                    if redop:
                        s["redop"] = redop
                    steps.append(s)
    return steps


@pytest.mark.parametrize("nranks,count", [(3, 1001), (4, 37), (1, 5), (2, 4099)])
def test_every_collective_dtype_and_redop(daemon, nranks, count):
    ranks = run_ranks(daemon, nranks, steps_for(nranks, count))
    assert_all_pass(ranks)
    res = ranks[0].results()
    assert len(res) == len(steps_for(nranks, count))
    assert all(r["result"] == "ok" and r["wrong"] == 0 for r in res)


def bitwise_steps(nranks, count):
    steps = []
    seed = 100
    for dt in INT_DTYPES:
        for op in REDUCING:
            for redop in BITWISE_REDOPS:
                for inplace in (False, True):
                    seed += 1
                    steps.append({"op": op, "dtype": dt, "count": count, "redop": redop, "inplace": inplace,
                                  "seed": seed, "root": seed % nranks})
    return steps


@pytest.mark.parametrize("nranks,count", [(3, 1001), (4, 37), (1, 5), (2, 4099)])
def test_bitwise_reductions_on_every_integer_dtype(daemon, nranks, count):
    # The test client checks every received element against check.rs's reference, which uses
    # full-width bit patterns for bitwise ops (sign bits included).
    steps = bitwise_steps(nranks, count)
    assert len(steps) == len(INT_DTYPES) * len(REDUCING) * len(BITWISE_REDOPS) * 2
    ranks = run_ranks(daemon, nranks, steps)
    assert_all_pass(ranks)
    for r in ranks:
        res = r.results()
        assert len(res) == len(steps)
        assert all(x["result"] == "ok" and x["wrong"] == 0 for x in res), res


def test_large_bitwise_all_reduce_uses_parallel_and_streaming_paths(daemon):
    # 6 MiB of i64 per rank: parallel pieces and, out of place, non-temporal stores.
    steps = [{"op": "all_reduce", "dtype": "i64", "count": 3 * 262144 + 7, "redop": redop, "inplace": ip}
             for redop in BITWISE_REDOPS for ip in (False, True)]
    steps += [{"op": "reduce_scatter", "dtype": "u8", "count": 1_000_003, "redop": "bxor"}]
    assert_all_pass(run_ranks(daemon, 4, steps))


def bitwise_float_message(redop, dtype):
    return f"bitwise reduction {redop} is defined for integer dtypes only (got {dtype})"


def test_bitwise_reduction_of_floats_fails_on_every_rank(daemon):
    # Every rank posts the same bad op: each fails as invalid with the clear message, nothing waits
    # for a timeout, and the communicator stays usable.
    bad = [{"op": op, "dtype": dt, "count": 64, "redop": redop, "root": 1, "expect": "invalid"}
           for dt in FLOAT_DTYPES for op in REDUCING for redop in BITWISE_REDOPS]
    steps = bad + [{"op": "all_reduce", "dtype": "i32", "count": 64, "redop": "bxor"}]
    t0 = time.monotonic()
    ranks = run_ranks(daemon, 3, steps, timeout=60)
    assert time.monotonic() - t0 < 30
    assert_all_pass(ranks)
    for i, r in enumerate(ranks):
        res = r.results()
        assert len(res) == len(steps)
        for step, x in zip(bad, res):
            assert x["result"] == "invalid", (i, x)
            assert bitwise_float_message(step["redop"], step["dtype"]) in x["message"], (i, x)
            assert "posted an invalid op" in x["message"], (i, x)
        assert res[-1]["result"] == "ok" and res[-1]["wrong"] == 0


def test_bitwise_reduction_of_floats_on_one_rank_fails_on_every_rank(daemon):
    # Only rank 1 asks for bxor of f32: its op still takes its sequence number, so the others learn
    # which rank posted what instead of hanging or pairing it with a later op.
    def steps(r):
        dt = "f32" if r == 1 else "i32"
        return [{"op": "all_reduce", "dtype": dt, "count": 10, "redop": "bxor", "expect": "invalid"},
                {"op": "reduce", "dtype": "i8", "count": 10, "redop": "band", "root": 2}]

    ranks = run_ranks(daemon, 3, steps, timeout=60)
    assert_all_pass(ranks)
    for r in ranks:
        msg = r.results()[0]["message"]
        assert "rank 1 posted an invalid op" in msg and bitwise_float_message("bxor", "f32") in msg, msg


def test_large_op_uses_parallel_path(daemon):
    # 3 MiB per rank crosses the parallel and non-temporal thresholds of the engine.
    steps = [{"op": "all_reduce", "dtype": "f32", "count": 3 * 262144 + 7, "redop": "sum", "inplace": ip}
             for ip in (False, True)]
    steps += [{"op": "all_gather", "dtype": "bf16", "count": 1_000_003}]
    assert_all_pass(run_ranks(daemon, 4, steps))


def test_send_recv_ring_and_exchange(daemon):
    n = 3

    def steps(r):
        nxt, prv = (r + 1) % n, (r - 1) % n
        return [
            # a ring: everyone sends to the next and receives from the previous, as one group
            {"group": [{"op": "send", "dtype": "i32", "count": 1001, "peer": nxt, "seed": 10 + r},
                       {"op": "recv", "dtype": "i32", "count": 1001, "peer": prv, "seed": 10 + prv}]},
            # an exchange posted recv-first on one side
            {"group": [{"op": "recv", "dtype": "f64", "count": 77, "peer": prv, "seed": 20 + prv},
                       {"op": "send", "dtype": "f64", "count": 77, "peer": nxt, "seed": 20 + r}]},
            {"op": "all_reduce", "dtype": "f32", "count": 11},
        ]

    assert_all_pass(run_ranks(daemon, n, steps))


def test_count_beyond_2_pow_31(daemon):
    # 2^31 + 5 u8 elements in place on 2 ranks: no 32-bit truncation anywhere.
    count = (1 << 31) + 5
    steps = [{"op": "all_reduce", "dtype": "u8", "count": count, "redop": "max", "inplace": True,
              "check_stride": 4093}]
    ranks = run_ranks(daemon, 2, steps, timeout=300)
    assert_all_pass(ranks)


def test_bench_smoke(tmp_path):
    import subprocess
    from conftest import COMMD
    for op in ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv"]:
        out = subprocess.run([COMMD, "bench", "--op", op, "--ranks", "3", "--min-bytes", "8", "--max-bytes", "64K",
                              "--step-factor", "8", "--dtype", "bf16"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        rows = [l for l in out.stdout.splitlines() if l and not l.startswith("#")]
        assert len(rows) == 5, out.stdout
        for row in rows:
            cols = row.split()
            assert cols[9] == "0" and cols[14] == "0", row  # the #wrong columns
        assert "memcpy reference" in out.stdout
        assert "all results correct" in out.stdout


def test_bench_bitwise_reductions():
    import subprocess
    from conftest import COMMD
    for op, dtype, redop in [("all_reduce", "i32", "bxor"), ("reduce_scatter", "u8", "band"),
                             ("reduce", "i64", "bor")]:
        out = subprocess.run([COMMD, "bench", "--op", op, "--ranks", "3", "--min-bytes", "8", "--max-bytes", "64K",
                              "--step-factor", "8", "--dtype", dtype, "--redop", redop],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        rows = [l for l in out.stdout.splitlines() if l and not l.startswith("#")]
        assert len(rows) == 5, out.stdout
        for row in rows:
            cols = row.split()
            assert cols[9] == "0" and cols[14] == "0", row  # the #wrong columns
        assert "all results correct" in out.stdout
    out = subprocess.run([COMMD, "bench", "--ranks", "2", "--redop", "bxor", "--dtype", "f32"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and bitwise_float_message("bxor", "f32") in out.stderr, out.stderr
