"""Every collective and dtype, odd counts, in-place and out-of-place, against the reference."""

import pytest

from conftest import assert_all_pass, run_ranks

DTYPES = ["f32", "f64", "f16", "bf16", "i8", "u8", "i32", "i64"]
REDOPS = ["sum", "prod", "min", "max", "avg"]
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
            assert cols[8] == "0" and cols[13] == "0", row
        assert "memcpy reference" in out.stdout
        assert "all results correct" in out.stdout
