"""`commd config` precedence and validation, `commd status`, exit codes, through the real binary."""

import json
import os
import subprocess

import pytest

from conftest import COMMD, Daemon, run_ranks


def commd(*args, env=None, config=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("COMMD_")}
    e.update(env or {})
    cmd = [COMMD, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=30)


def line(out, key):
    return next(l for l in out.splitlines() if l.startswith(key + " "))


def test_config_precedence_flag_env_file_default(tmp_path):
    f = tmp_path / "commd.toml"
    f.write_text("op_timeout_ms = 1111\nworkers = 3\njoin_timeout_ms = 2222\n")
    out = commd("--config", str(f), "--set", "op_timeout_ms=3333", "config",
                env={"COMMD_OP_TIMEOUT_MS": "4444", "COMMD_WORKERS": "5"})
    assert out.returncode == 0, out.stderr
    assert "3333" in line(out.stdout, "op_timeout_ms") and "[flag;" in line(out.stdout, "op_timeout_ms")
    assert "5 " in line(out.stdout, "workers") and "env COMMD_WORKERS" in line(out.stdout, "workers")
    assert "2222" in line(out.stdout, "join_timeout_ms") and f"file {f}" in line(out.stdout, "join_timeout_ms")
    assert "default" in line(out.stdout, "poll_spin_us")


def test_config_rejects_bad_values_by_name(tmp_path):
    out = commd("config", env={"COMMD_WORKERS": "lots"})
    assert out.returncode == 2 and "workers" in out.stderr and "COMMD_WORKERS" in out.stderr, out.stderr
    out = commd("--set", "no_such_key=1", "config")
    assert out.returncode == 2 and "unknown config key 'no_such_key'" in out.stderr, out.stderr
    f = tmp_path / "bad.toml"
    f.write_text("ring_entries = 1000\n")
    out = commd("--config", str(f), "serve")
    assert out.returncode == 2 and "power of two" in out.stderr, out.stderr
    out = commd("--config", str(tmp_path / "missing.toml"), "config")
    assert out.returncode == 2 and "missing.toml" in out.stderr
    out = commd("config", env={"COMMD_METRICS_PER_JOB": "maybe"})
    assert out.returncode == 2 and "metrics_per_job" in out.stderr and "on or off" in out.stderr, out.stderr


def test_status_counts_sessions_and_registrations(daemon):
    st = daemon.status()
    assert st["sessions"] == 0 and st["communicators"] == 0
    run_ranks(daemon, 2, [{"op": "all_reduce", "dtype": "f32", "count": 10}])
    st = daemon.wait_status(lambda s: s["sessions"] == 0)
    assert st["ops_completed"] >= 2 and st["ops_failed"] == 0, st
    out = subprocess.run([COMMD, "status", "--socket", str(daemon.socket)], capture_output=True, text=True)
    assert out.returncode == 0 and "0 sessions" in out.stdout, out.stdout


def test_bench_rejects_bad_arguments():
    out = commd("bench", "--op", "frobnicate")
    assert out.returncode == 2 and "unknown op 'frobnicate'" in out.stderr, out.stderr
    assert "valid: all_reduce, all_gather" in out.stderr, out.stderr
    out = commd("bench", "-d", "float128")
    assert out.returncode == 2 and "valid: f32" in out.stderr, out.stderr
    out = commd("bench", "-c", "2")
    assert out.returncode == 2, out.stderr
    out = commd("bench", "--max-bytes", "12Q")
    assert out.returncode == 2 and "invalid size" in out.stderr, out.stderr
    out = commd("bench", "--ranks", "2", "--root", "5", "--op", "broadcast")
    assert out.returncode == 1 and "--root 5 is out of range" in out.stderr, out.stderr


def test_bench_speaks_nccl_tests():
    """nccl-tests' flags and spellings, its closing lines, a root column, and CSV."""
    out = commd("bench", "--op", "broadcast", "-r", "1", "--ranks", "2", "-b", "8", "-e", "4K",
                "-f", "8", "-n", "3", "-w", "1", "-c", "1", "-d", "float")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("# commd bench: starting 2 client process"), lines[0]
    assert any(l.split()[1:6] == ["size", "count", "type", "redop", "root"] for l in lines), out.stdout
    rows = [l.split() for l in lines if l and not l.startswith("#")]
    assert [r[0] for r in rows] == ["8", "64", "512", "4096"] and all(r[4] == "1" for r in rows), rows
    assert "# Out of bounds values : 0 OK" in lines, out.stdout
    avg = [l for l in lines if l.startswith("# Avg bus bandwidth    : ")]
    assert len(avg) == 1 and float(avg[0].split(":")[1]) > 0, avg
    out = commd("bench", "--op", "allreduce", "--ranks", "2", "-e", "64", "--csv")
    assert out.returncode == 0, out.stderr
    csv = out.stdout.splitlines()
    assert csv[0].startswith("op,ranks,nodes,dtype,redop,root,size"), csv[0]
    assert len(csv) == 1 + 2 * 4 and all(l.startswith("all_reduce,2,1,f32,sum,-1,") for l in csv[1:]), csv
    assert all(l.endswith(",0") for l in csv[1:]), csv


def test_bench_takes_nccl_tests_all_dtypes_all_reductions_and_averaging():
    """nccl-tests' `-d all` and `-o all` (every dtype, then sum/prod/min/max/avg, each checked),
    `-i` (additive steps), `-a` (how ranks' times combine) and `-t`/`-g` (refused but for 1)."""
    out = commd("bench", "--op", "all_reduce", "--ranks", "2", "-d", "all", "-o", "max",
                "-b", "64", "-e", "64", "-n", "2", "-w", "1", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
    assert sorted({r["dtype"] for r in rows}) == sorted(
        ["f32", "f64", "f16", "bf16", "i8", "u8", "i32", "i64", "u32", "u64", "f8e4m3", "f8e5m2"]), rows
    assert all(r["wrong"] == 0 and r["redop"] == "max" for r in rows), rows
    out = commd("bench", "--op", "all_reduce", "--ranks", "2", "-d", "i32", "-o", "all",
                "-b", "64", "-e", "64", "-n", "2", "-w", "1", "--json", "-a", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
    assert [r["redop"] for r in rows[::2]] == ["sum", "prod", "min", "max", "avg"], rows
    out = commd("bench", "--ranks", "2", "-b", "1K", "-e", "3K", "-i", "1K", "-n", "2", "-w", "1",
                "--json")
    assert out.returncode == 0, out.stderr
    assert [json.loads(l)["size"] for l in out.stdout.splitlines()
            if l.startswith("{")][::2] == [1024, 2048, 3072], out.stdout
    out = commd("bench", "-t", "2")
    assert out.returncode != 0 and "--ranks" in out.stderr, out.stderr


def test_bench_plain_memory_is_staged_and_checked():
    """`--memory plain`: each rank's data in ordinary memory, copied through staging around
    every timed op; the check reads the result from that memory, for every op, in and out of
    place."""
    for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "sendrecv"):
        out = commd("bench", "--op", op, "--ranks", "3", "-b", "8", "-e", "64K", "-f", "64",
                    "-n", "3", "-w", "1", "--memory", "plain", "--json")
        assert out.returncode == 0, op + out.stdout + out.stderr
        rows = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
        assert len(rows) == 2 * 3, (op, rows)
        assert all(r["memory"] == "plain" and r["wrong"] == 0 and r["time_us"] > 0 for r in rows), rows
        # Where the time went: the staging copies around the op itself.
        assert all(r["phases"]["copy_in_us"] > 0 and r["phases"]["copy_out_us"] > 0
                   and r["phases"]["op_us"] > 0 for r in rows), rows
    out = commd("bench", "--memory", "pinned")
    assert out.returncode == 2 and "registered" in out.stderr and "plain" in out.stderr, out.stderr


def test_bench_allocator_memory_runs_in_place_and_is_checked():
    """`--memory allocator`: each rank's data in blocks of commd's CPU allocator (what ordinary
    torch tensors and numpy arrays of 1 MiB and up get), moved into shared memory by the first
    op and used in place after it; the check reads the result from the blocks, for every op,
    in and out of place, and no op copies through staging."""
    for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "sendrecv"):
        out = commd("bench", "--op", op, "--ranks", "3", "-b", "8", "-e", "64K", "-f", "64",
                    "-n", "3", "-w", "1", "--memory", "allocator", "--json")
        assert out.returncode == 0, op + out.stdout + out.stderr
        rows = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
        assert len(rows) == 2 * 3, (op, rows)
        assert all(r["memory"] == "allocator" and r["wrong"] == 0 for r in rows), rows
        assert all(r["phases"]["copy_in_us"] == 0 and r["phases"]["copy_out_us"] == 0
                   and r["phases"]["op_us"] > 0 and r["phases"]["first_us"] > 0
                   for r in rows), rows
    out = commd("bench", "--ranks", "2", "-b", "1M", "-e", "1M", "-n", "2", "-w", "1",
                "--memory", "allocator")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "phases, median us: out of place: first" in out.stdout, out.stdout


def test_logs_to_a_file_carry_no_colour_codes_and_bench_ends_quietly():
    """A daemon whose stderr is a file (the journal, a log file) writes no ANSI escapes, and a
    normal `commd bench` (embedded daemon) logs no warning when it stops it."""
    for nodes in ("1", "2"):
        out = commd("bench", "--nodes", nodes, "--ranks", "2", "--op", "all_reduce",
                    "--max-bytes", "4K")
        assert out.returncode == 0, out.stderr
        assert "\x1b[" not in out.stderr, repr(out.stderr[:500])
        assert "WARN" not in out.stderr and "ERROR" not in out.stderr, out.stderr[-2000:]


def test_logs_to_a_file_carry_no_colour_codes(daemon):
    """A daemon whose stderr is a file (the journal, a log file) writes no ANSI escapes."""
    run_ranks(daemon, 2, [{"op": "all_reduce", "dtype": "f32", "count": 16}])
    log = daemon.log()
    assert "commd" in log and "serving" in log, log[-2000:]
    assert "\x1b[" not in log, repr(log[:500])


def test_serve_says_where_it_listens_at_the_default_level(tmp_path):
    """`commd serve` at the default log level (WARN) prints one ready line naming its socket,
    its metrics URL and its peer address, and warns of a COMMD_* variable nothing reads with
    the name it is closest to; COMMD_DEBUG=ERROR keeps it quiet."""
    (tmp_path / "warn").mkdir()
    d = Daemon(tmp_path / "warn", env={"COMMD_DEBUG": "WARN", "COMMD_WROKERS": "4"})
    d.start()
    try:
        line = next((ln for ln in d.log().splitlines() if " ready: socket " in ln), None)
        assert line is not None, d.log()[-2000:]
        assert str(d.socket) in line and "/metrics" in line and "peers 127.0.0.1:" in line, line
        assert "peers 127.0.0.1:0" not in line, line  # the bound port, not the setting
        assert "INFO" in line and "serving" not in d.log(), d.log()[-2000:]
        # A COMMD_* typo is warned (clients' variables share the prefix: not refused).
        assert "COMMD_WROKERS is not a commd setting" in d.log(), d.log()[-2000:]
        assert "did you mean 'COMMD_WORKERS'?" in d.log(), d.log()[-2000:]
    finally:
        d.stop()
    (tmp_path / "error").mkdir()
    q = Daemon(tmp_path / "error", env={"COMMD_DEBUG": "ERROR"})
    q.start()
    try:
        assert " ready: " not in q.log(), q.log()[-2000:]
    finally:
        q.stop()


def _proto_fields(buf):
    """The top-level (field number, value) pairs of a protobuf message: varints and
    length-delimited values only, which is what StatusReply's first fields are."""
    def varint(i):
        n = shift = 0
        while True:
            b = buf[i]
            n |= (b & 0x7F) << shift
            i += 1
            if b < 0x80:
                return n, i
            shift += 7
    out, i = {}, 0
    while i < len(buf):
        key, i = varint(i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            out[field], i = varint(i)
        elif wire == 2:
            n, i = varint(i)
            out[field], i = bytes(buf[i:i + n]), i + n
        else:
            break
    return out


def test_a_grpc_core_client_reaches_the_socket_without_setting_an_authority(daemon):
    """grpcio (gRPC C-core) sends the percent-encoded socket path as `:authority`, which h2
    refuses; the daemon rewrites it. Several calls on one channel (HPACK's dynamic table is
    carried from block to block), one with headers over 16 KiB (CONTINUATION frames), and the
    Admin service on the same socket."""
    import grpc
    with grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
        status = ch.unary_unary("/commd.v1.Local/Status")
        for i in range(3):
            reply = _proto_fields(status(b"", timeout=10, metadata=[("x-call", str(i))]))
            assert reply[2] == daemon.proc.pid, reply
            assert reply[1].decode(), reply
        big = _proto_fields(status(b"", timeout=10, metadata=[("x-big", "v" * 12000)]))
        assert big[2] == daemon.proc.pid
        # Over the server's 16 KiB header list limit: the answer a client whose authority
        # needs no rewrite gets too (HTTP 431), not a reset connection.
        answers = []
        for opts in ([], [("grpc.default_authority", "localhost")]):
            with grpc.insecure_channel(f"unix:{daemon.socket}", options=opts) as c2:
                with pytest.raises(grpc.RpcError) as e:
                    c2.unary_unary("/commd.v1.Local/Status")(
                        b"", timeout=10, metadata=[("x-big", "v" * 40000)])
                answers.append((e.value.code(), e.value.details()))
        assert answers[0] == answers[1], answers
        assert "431" in answers[0][1], answers
        assert status(b"", timeout=10)
        admin = ch.unary_unary("/commd.v1.Admin/GetStatus")
        admin(b"", timeout=10)
        # An unknown method still gets gRPC's own answer, not a reset stream.
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/commd.v1.Local/NoSuchCall")(b"", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, e.value


def test_switch_listens_on_loopback_by_default():
    """`commd switch` binds loopback unless told otherwise, like the daemon's socket, metrics
    and peer listeners (it listened on 0.0.0.0)."""
    out = commd("switch", "--help")
    assert out.returncode == 0, out.stderr
    assert "[default: 127.0.0.1:50099]" in out.stdout, out.stdout
    assert "[default: 127.0.0.1:48864]" in out.stdout, out.stdout
    assert "0.0.0.0" not in out.stdout, out.stdout
