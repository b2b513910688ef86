// Error paths of the C and C++ APIs against a real daemon: errors_test CASE [ARGS].
//
// Each case exits 0 when every check held, 1 otherwise (with the failed check on stderr).
// Cases that need a daemon find it through $COMMD_SOCKET (the ctest fixture), except
// `shutdown`, which starts and stops its own from the commd binary given as its argument.
#include <commd.hpp>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <map>
#include <string>
#include <thread>

#include "ranks.hpp"

using namespace std::chrono_literals;
using commd::RedOp;
using test::contains;
using test::expect_throw;
using test::Rank;
using test::run_ranks;
using test::seconds_since;

namespace {

// ---------------------------------------------------------------------------------------------
void missing_socket() {
  const std::string path = "/nonexistent-commd-test-dir/commd.sock";
  // C++: an explicit path.
  auto e = expect_throw<commd::DaemonUnavailableError>("Session(missing path)",
                                                       [&] { commd::Session s(path); });
  CHECK_THAT(e.status() == COMMD_DAEMON_UNAVAILABLE, e.status_name());
  CHECK_THAT(contains(e.what(), path), "message does not name the path: " << e.what());
  CHECK_THAT(contains(e.what(), "commd serve"), "message says what to do: " << e.what());

  // C++: the path from $COMMD_SOCKET.
  const std::string env_path = "/nonexistent-commd-test-dir/from-env.sock";
  setenv("COMMD_SOCKET", env_path.c_str(), 1);
  auto e2 = expect_throw<commd::DaemonUnavailableError>("Session() with COMMD_SOCKET",
                                                        [&] { commd::Session s; });
  CHECK_THAT(contains(e2.what(), env_path), "message does not name $COMMD_SOCKET: " << e2.what());

  // C: status, NULL out-pointer, last error.
  commd_session_t* s = reinterpret_cast<commd_session_t*>(0x1);
  commd_status_t st = commd_session_open(path.c_str(), &s);
  CHECK_THAT(st == COMMD_DAEMON_UNAVAILABLE, commd_status_name(st));
  CHECK_THAT(s == nullptr, "out-pointer not cleared on failure");
  CHECK_THAT(contains(commd_last_error(), "commd_session_open"), commd_last_error());
  CHECK_THAT(contains(commd_last_error(), path), commd_last_error());

  // The message is per thread: another thread has its own (empty) one.
  std::string other = "unset";
  std::thread([&] { other = commd_last_error(); }).join();
  CHECK_THAT(other.empty(), "another thread sees '" << other << "'");
}

// ---------------------------------------------------------------------------------------------
void invalid_arguments() {
  // NULL handles and out-pointers, C API.
  CHECK_THAT(commd_session_open(nullptr, nullptr) == COMMD_INVALID_ARGUMENT, "NULL out");
  CHECK_THAT(contains(commd_last_error(), "out is NULL"), commd_last_error());
  std::uint32_t r = 7;
  CHECK_THAT(commd_comm_rank(nullptr, &r) == COMMD_INVALID_ARGUMENT, "NULL comm");
  CHECK_THAT(contains(commd_last_error(), "comm is NULL"), commd_last_error());
  CHECK_THAT(commd_request_wait(nullptr) == COMMD_INVALID_ARGUMENT, "NULL request");
  CHECK_THAT(commd_buffer_data(nullptr) == nullptr && commd_buffer_size(nullptr) == 0, "NULL buffer");
  commd_request_free(nullptr);
  commd_buffer_free(nullptr);
  commd_comm_destroy(nullptr);
  commd_session_close(nullptr);
  CHECK_THAT(std::string(commd_status_name(12345)) == "COMMD_UNKNOWN_STATUS", "unknown status");
  CHECK_THAT(std::string(commd_status_name(COMMD_PEER_LOST)) == "COMMD_PEER_LOST", "status name");
  CHECK_THAT(commd_dtype_size(COMMD_BFLOAT16) == 2 && commd_dtype_size(99) == 0, "dtype size");
  CHECK_THAT(commd::dtype_size(commd::dtype_v<std::int64_t>) == 8, "dtype_v");
  expect_throw<commd::InvalidArgumentError>("from_hex", [] { commd::UniqueId::from_hex("12zz"); });

  commd::Session session;
  commd::Session other;
  expect_throw<commd::InvalidArgumentError>("alloc(0)", [&] { session.alloc(0); });
  // Sizes the system refuses: the caller's error, naming the size (not COMMD_INTERNAL).
  auto huge = expect_throw<commd::InvalidArgumentError>(
      "alloc(2^63)", [&] { session.alloc(std::uint64_t{1} << 63); });
  CHECK_THAT(contains(huge.what(), "9223372036854775808 bytes"), huge.what());
  auto oob_rank = expect_throw<commd::InvalidArgumentError>(
      "rank >= nranks", [&] { session.communicator(session.unique_id(), 2, 2); });
  CHECK_THAT(contains(oob_rank.what(), "out of range"), oob_rank.what());
  auto bogus = expect_throw<commd::InvalidArgumentError>(
      "unknown unique id", [&] { session.communicator(commd::UniqueId(), 0, 1, 0ms, 2000ms); });
  std::cerr << "(unknown id: " << bogus.what() << ")\n";

  commd::Communicator comm = session.communicator(session.unique_id(), 0, 1);
  CHECK_THAT(comm.rank() == 0 && comm.size() == 1, "rank/size");
  commd::Buffer b = session.alloc_array<float>(16);
  commd::Buffer foreign = other.alloc_array<float>(16);

  // Codes the library does not know: checked before anything is posted.
  commd_status_t st = commd_all_reduce(comm.get(), b.get(), 0, b.get(), 0, 4, 99, COMMD_SUM, nullptr);
  CHECK_THAT(st == COMMD_INVALID_ARGUMENT, commd_status_name(st));
  CHECK_THAT(contains(commd_last_error(), "unknown dtype code 99"), commd_last_error());
  st = commd_all_reduce(comm.get(), b.get(), 0, b.get(), 0, 4, COMMD_FLOAT32, 42, nullptr);
  CHECK_THAT(st == COMMD_INVALID_ARGUMENT, commd_status_name(st));
  CHECK_THAT(contains(commd_last_error(), "reduction code 42"), commd_last_error());
  expect_throw<commd::InvalidArgumentError>("DType 200", [&] {
    comm.all_reduce(b, b, 4, static_cast<commd::DType>(200), RedOp::Sum);
  });
  // A peer or root past the ranks, -1 included: refused before posting (the Rust client reads
  // a peer of UINT32_MAX as "any source", which the C API has not: it received from whichever
  // rank sent first).
  st = commd_recv(comm.get(), b.get(), 0, 4, COMMD_FLOAT32, UINT32_MAX, nullptr);
  CHECK_THAT(st == COMMD_INVALID_ARGUMENT, commd_status_name(st));
  CHECK_THAT(contains(commd_last_error(), "peer 4294967295 is out of range"), commd_last_error());
  st = commd_send(comm.get(), b.get(), 0, 4, COMMD_FLOAT32, 1, nullptr);
  CHECK_THAT(st == COMMD_INVALID_ARGUMENT, commd_status_name(st));
  CHECK_THAT(contains(commd_last_error(), "peer 1 is out of range for 1 ranks"), commd_last_error());
  // Element offsets past 64 bits throw instead of wrapping to another element.
  expect_throw<commd::InvalidArgumentError>("at_elem(2^61 + 1)", [&] {
    (void)b.at_elem<double>((std::uint64_t{1} << 61) + 1);
  });
  commd_request_t* req = reinterpret_cast<commd_request_t*>(0x1);
  st = commd_all_reduce(comm.get(), b.get(), 0, b.get(), 0, 4, 1u << 20, COMMD_SUM, &req);
  CHECK_THAT(st == COMMD_INVALID_ARGUMENT && req == nullptr, "request not cleared on failure");

  // Missing buffers: checked before posting.
  auto nobuf = expect_throw<commd::InvalidArgumentError>(
      "NULL send", [&] { comm.all_reduce<float>(commd::At(), b, 4, RedOp::Sum); });
  CHECK_THAT(contains(nobuf.what(), "needs a send buffer"), nobuf.what());
  auto foreign_e = expect_throw<commd::InvalidArgumentError>(
      "buffer of another session", [&] { comm.all_reduce<float>(foreign, b, 4, RedOp::Sum); });
  CHECK_THAT(contains(foreign_e.what(), "another client session"), foreign_e.what());

  // Bounds and alignment: checked by the daemon, reported when the op completes.
  auto oob = expect_throw<commd::InvalidArgumentError>(
      "count past the buffer", [&] { comm.all_reduce<float>(b, b, 17, RedOp::Sum); });
  CHECK_THAT(contains(oob.what(), "outside"), oob.what());
  auto oob_async = expect_throw<commd::InvalidArgumentError>("offset past the buffer (async)", [&] {
    commd::Request q = comm.all_reduce_async<float>(b.at(64), b, 1, RedOp::Sum);
    q.wait();
  });
  CHECK_THAT(contains(oob_async.what(), "all_reduce failed"), oob_async.what());
  auto mis = expect_throw<commd::InvalidArgumentError>(
      "misaligned offset", [&] { comm.all_reduce<float>(b.at(2), b, 1, RedOp::Sum); });
  CHECK_THAT(contains(mis.what(), "aligned"), mis.what());
  auto root = expect_throw<commd::InvalidArgumentError>(
      "root out of range", [&] { comm.broadcast<float>(b, b, 4, 5); });
  CHECK_THAT(contains(root.what(), "out of range"), root.what());

  // GPU pacing: 0 and >= 1 MB/s are accepted; a smaller nonzero cap is refused by the daemon.
  comm.set_pacing(2'000'000'000);
  comm.set_pacing(0);
  auto slow = expect_throw<commd::InvalidArgumentError>("pacing below 1 MB/s",
                                                        [&] { comm.set_pacing(5); });
  CHECK_THAT(contains(slow.what(), "minimum"), slow.what());
  CHECK_THAT(commd_comm_set_pacing(nullptr, 0) == COMMD_INVALID_ARGUMENT, "NULL comm");
  CHECK_THAT(contains(commd_last_error(), "comm is NULL"), commd_last_error());

  // The communicator still works after all that.
  for (int i = 0; i < 16; i++) b.as<float>()[i] = static_cast<float>(i);
  commd::Buffer out = session.alloc_array<float>(16);
  comm.all_reduce<float>(b, out, 16, RedOp::Max);
  for (int i = 0; i < 16; i++) CHECK_THAT(out.as<float>()[i] == i, "element " << i);
}

// ---------------------------------------------------------------------------------------------
void mismatch() {
  auto st = run_ranks(3, [](Rank& r) {
    commd::Communicator comm = r.session.communicator(r.id, r.rank, r.nranks, 60s);
    commd::Buffer b = r.session.alloc_array<float>(8);
    // Rank 1 disagrees on the count: every rank must learn it, quickly.
    std::size_t count = r.rank == 1 ? 8 : 4;
    auto t0 = std::chrono::steady_clock::now();
    auto e = expect_throw<commd::MismatchError>(
        "mismatched all_reduce", [&] { comm.all_reduce<float>(b, b, count, RedOp::Sum); });
    double took = seconds_since(t0);
    CHECK_THAT(took < 5, "took " << took << " s");
    CHECK_THAT(e.status() == COMMD_MISMATCH, e.status_name());
    CHECK_THAT(contains(e.what(), "count"), "message does not name the field: " << e.what());
    if (r.rank == 0) std::cerr << "(rank 0 got: " << e.what() << ")\n";
    // The communicator stays usable.
    for (int i = 0; i < 8; i++) b.as<float>()[i] = static_cast<float>(r.rank + i);
    comm.all_reduce<float>(b, b, 8, RedOp::Sum);
    for (int i = 0; i < 8; i++) CHECK_THAT(b.as<float>()[i] == 3 + 3 * i, "element " << i);
  });
  test::expect_all_ok(st);
}

// ---------------------------------------------------------------------------------------------
void peer_lost() {
  auto st = run_ranks(3, [](Rank& r) {
    // A long op timeout, so only the death of rank 2 can end the op.
    commd::Communicator comm = r.session.communicator(r.id, r.rank, r.nranks, 120s);
    comm.barrier();
    if (r.rank == 2) raise(SIGKILL);
    commd::Buffer b = r.session.alloc_array<double>(1024);
    auto t0 = std::chrono::steady_clock::now();
    auto e = expect_throw<commd::PeerLostError>(
        "all_reduce with a dead rank", [&] { comm.all_reduce<double>(b, b, 1024, RedOp::Sum); });
    double took = seconds_since(t0);
    CHECK_THAT(took < 5, "took " << took << " s");
    CHECK_THAT(contains(e.what(), "rank 2"), "message does not name the dead rank: " << e.what());
    if (r.rank == 0) std::cerr << "(rank 0 got: " << e.what() << ")\n";
    // Later ops fail too, at once.
    auto t1 = std::chrono::steady_clock::now();
    try {
      comm.barrier();
      CHECK_THAT(false, "a barrier on an aborted communicator succeeded");
    } catch (const commd::PeerLostError&) {
    } catch (const commd::AbortedError&) {
    }
    CHECK_THAT(seconds_since(t1) < 5, "later op took " << seconds_since(t1) << " s");
  });
  CHECK_THAT(test::exited_ok(st[0]) && test::exited_ok(st[1]), "a survivor failed");
  CHECK_THAT(WIFSIGNALED(st[2]) && WTERMSIG(st[2]) == SIGKILL, "rank 2 was not killed: " << st[2]);
}

// ---------------------------------------------------------------------------------------------
void op_timeout() {
  auto st = run_ranks(2, [](Rank& r) {
    commd::Communicator comm = r.session.communicator(r.id, r.rank, r.nranks, 500ms);
    if (r.rank == 1) {
      std::this_thread::sleep_for(3s);  // never posts the op
      return;
    }
    commd::Buffer b = r.session.alloc_array<std::int32_t>(4);
    auto t0 = std::chrono::steady_clock::now();
    auto e = expect_throw<commd::TimeoutError>(
        "all_reduce rank 1 never posts", [&] { comm.all_reduce<std::int32_t>(b, b, 4, RedOp::Sum); });
    double took = seconds_since(t0);
    CHECK_THAT(took > 0.4 && took < 5, "took " << took << " s for a 0.5 s timeout");
    CHECK_THAT(contains(e.what(), "1"), "message does not name rank 1: " << e.what());
    std::cerr << "(rank 0 got: " << e.what() << ")\n";
  });
  test::expect_all_ok(st);
}

// ---------------------------------------------------------------------------------------------
void join_timeout() {
  commd::Session session;
  auto t0 = std::chrono::steady_clock::now();
  auto e = expect_throw<commd::TimeoutError>("join with a missing rank", [&] {
    session.communicator(session.unique_id(), 0, 2, 0ms, 300ms);
  });
  double took = seconds_since(t0);
  CHECK_THAT(took > 0.25 && took < 5, "took " << took << " s for a 0.3 s join timeout");
  CHECK_THAT(contains(e.what(), "1"), "message does not name rank 1: " << e.what());
  std::cerr << "(got: " << e.what() << ")\n";
}

// ---------------------------------------------------------------------------------------------
void requests() {
  auto st = run_ranks(2, [](Rank& r) {
    commd::Communicator comm = r.session.communicator(r.id, r.rank, r.nranks, 60s);
    commd::Buffer v = r.session.alloc_array<std::int64_t>(4);
    commd::Buffer go = r.session.alloc_array<std::int64_t>(1);
    if (r.rank == 0) {
      // Rank 1 sends only after receiving `go`, which rank 0 sends after these checks: the
      // recv cannot have completed yet.
      commd::Request rq = comm.recv_async<std::int64_t>(v, 4, 1);
      CHECK_THAT(!rq.test(), "recv completed before its send was posted");
      auto t0 = std::chrono::steady_clock::now();
      CHECK_THAT(!rq.wait_for(50ms), "wait_for completed early");
      CHECK_THAT(seconds_since(t0) >= 0.045, "wait_for returned after " << seconds_since(t0));
      commd_request_t* raw = rq.get();
      CHECK_THAT(commd_request_wait_timeout(raw, 0) == COMMD_IN_PROGRESS, "C wait_timeout");
      // Another thread waits without a limit: test() and wait_for() here still keep theirs
      // (they once waited for that thread's wait, until the op ended).
      std::thread waiter([&] { rq.wait(); });
      std::this_thread::sleep_for(20ms);
      auto t1 = std::chrono::steady_clock::now();
      CHECK_THAT(!rq.test(), "test beside a wait: completed");
      CHECK_THAT(!rq.wait_for(50ms), "wait_for beside a wait: completed");
      CHECK_THAT(seconds_since(t1) < 1.0, "test + wait_for(50ms) beside a wait took " << seconds_since(t1));
      go.as<std::int64_t>()[0] = 42;
      comm.send<std::int64_t>(go, 1, 1);
      waiter.join();
      commd::Request moved = std::move(rq);
      CHECK_THAT(!rq && moved, "move");
      moved.wait();
      moved.wait();  // again: same result
      CHECK_THAT(moved.test(), "test after completion");
      for (int i = 0; i < 4; i++) CHECK_THAT(v.as<std::int64_t>()[i] == 42 + i, "element " << i);
    } else {
      comm.recv<std::int64_t>(go, 1, 0);
      for (int i = 0; i < 4; i++) v.as<std::int64_t>()[i] = go.as<std::int64_t>()[0] + i;
      comm.send<std::int64_t>(v, 4, 0);
    }
    // A request destroyed unwaited: the op still runs, and later ops are unaffected.
    commd::Buffer x = r.session.alloc_array<float>(256);
    { commd::Request dropped = comm.all_reduce_async<float>(x, x, 256, RedOp::Sum); }
    for (int i = 0; i < 16; i++) {
      commd::Buffer y = r.session.alloc_array<float>(4);
      for (int k = 0; k < 4; k++) y.as<float>()[k] = static_cast<float>(r.rank + i);
      comm.all_reduce<float>(y, y, 4, RedOp::Sum);
      CHECK_THAT(y.as<float>()[3] == 1 + 2 * i, "iteration " << i);
    }
    // A failed request reports the same error on every wait.
    commd::Request bad = comm.all_reduce_async<float>(x.at(1024), x, 1, RedOp::Sum);
    auto e1 = expect_throw<commd::InvalidArgumentError>("bad wait 1", [&] { bad.wait(); });
    auto e2 = expect_throw<commd::InvalidArgumentError>("bad wait 2", [&] { bad.test(); });
    // (each message starts with the C function that reported it)
    auto op_part = [](const std::string& m) { return m.substr(m.find("all_reduce failed")); };
    CHECK_THAT(contains(e1.what(), "all_reduce failed") && op_part(e1.what()) == op_part(e2.what()),
               e1.what() << " vs " << e2.what());
  });
  test::expect_all_ok(st);
}

// ---------------------------------------------------------------------------------------------
void bitwise() {
  auto st = run_ranks(3, [](Rank& r) {
    commd::Communicator comm = r.session.communicator(r.id, r.rank, r.nranks, 60s);
    commd::Buffer b = r.session.alloc_array<std::int32_t>(3);
    commd::Buffer u = r.session.alloc_array<std::uint8_t>(3);
    auto* x = b.as<std::int32_t>();
    auto* y = u.as<std::uint8_t>();
    // Rank q contributes bit q and a common bit 0x100 (0x10 for u8).
    for (int op = 0; op < 3; op++) {
      x[op] = (1 << r.rank) | 0x100;
      y[op] = static_cast<std::uint8_t>((1 << r.rank) | 0x10);
    }
    comm.all_reduce<std::int32_t>(b.at_elem<std::int32_t>(0), b.at_elem<std::int32_t>(0), 1, RedOp::BitAnd);
    comm.all_reduce<std::int32_t>(b.at_elem<std::int32_t>(1), b.at_elem<std::int32_t>(1), 1, RedOp::BitOr);
    comm.all_reduce<std::int32_t>(b.at_elem<std::int32_t>(2), b.at_elem<std::int32_t>(2), 1, RedOp::BitXor);
    CHECK_THAT(x[0] == 0x100, "band " << x[0]);
    CHECK_THAT(x[1] == 0x107, "bor " << x[1]);
    CHECK_THAT(x[2] == 0x107, "bxor " << x[2]);  // 3 ranks: the common bit survives xor
    comm.all_reduce<std::uint8_t>(u, u, 3, RedOp::BitXor);
    CHECK_THAT(y[0] == 0x17, "u8 bxor " << +y[0]);
    // Bitwise reductions are for integers only.
    commd::Buffer f = r.session.alloc_array<float>(1);
    auto e = expect_throw<commd::InvalidArgumentError>(
        "band on float32", [&] { comm.all_reduce<float>(f, f, 1, RedOp::BitAnd); });
    if (r.rank == 0) std::cerr << "(band on float32: " << e.what() << ")\n";
  });
  test::expect_all_ok(st);
}

// ---------------------------------------------------------------------------------------------
// Handles are usable from any thread: one session, two ranks of one communicator on two threads
// (both joins block until the other arrives), each posting its own ops concurrently, plus a
// third thread waiting on a request that another thread posted.
void threads() {
  commd::Session session;
  commd::UniqueId id = session.unique_id();
  std::string errors[2];
  auto rank_main = [&](unsigned rank) {
    try {
      commd::Communicator comm = session.communicator(id, rank, 2, 60s, 30s);
      commd::Buffer b = session.alloc_array<std::int64_t>(256);
      for (int it = 0; it < 50; it++) {
        for (int i = 0; i < 256; i++) b.as<std::int64_t>()[i] = rank * 1000 + it + i;
        commd::Request r = comm.all_reduce_async<std::int64_t>(b, b, 256, RedOp::Sum);
        std::thread waiter([&] { r.wait(); });
        waiter.join();
        for (int i = 0; i < 256; i++) {
          CHECK_THAT(b.as<std::int64_t>()[i] == 1000 + 2 * (it + i), "iteration " << it << " element " << i);
        }
      }
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  };
  std::thread t0(rank_main, 0), t1(rank_main, 1);
  t0.join();
  t1.join();
  CHECK_THAT(errors[0].empty() && errors[1].empty(), "rank 0: " << errors[0] << "; rank 1: " << errors[1]);
}

// ---------------------------------------------------------------------------------------------
// Starts `commd serve` on a private socket, posts an op that cannot complete, stops the daemon
// with SIGTERM: the op fails with ShutdownError, later calls with DaemonLostError, and the daemon
// exits 0.
void shutdown(const char* commd_bin) {
  char dir[] = "/tmp/commd-cpp-shutdown-XXXXXX";
  CHECK_THAT(mkdtemp(dir) != nullptr, "mkdtemp");
  std::string sock = std::string(dir) + "/commd.sock";
  std::string log = std::string(dir) + "/commd.log";
  pid_t daemon = fork();
  if (daemon == 0) {
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 1);
    dup2(fd, 2);
    execl(commd_bin, commd_bin, "serve", "--socket", sock.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  auto fail = [&](const std::string& what) {
    kill(daemon, SIGKILL);
    waitpid(daemon, nullptr, 0);
    std::string cmd = "cat " + log;
    std::cerr << "---- commd log ----\n" << std::flush;
    CHECK_THAT(std::system(cmd.c_str()) >= 0, "cat");
    throw test::Failed(what);
  };
  // Wait for the socket (without opening a session in this process, which forks below).
  struct stat sb;
  auto t0 = std::chrono::steady_clock::now();
  while (stat(sock.c_str(), &sb) != 0) {
    if (seconds_since(t0) > 10) fail("commd did not create its socket in 10 s");
    std::this_thread::sleep_for(20ms);
  }
  setenv("COMMD_SOCKET", sock.c_str(), 1);
  // posted: rank 0 -> stopper ("the op is in flight"); done: rank 0 -> rank 1 ("you may go";
  // rank 1 must stay until then, or its exit would fail the op as peer-lost instead).
  int posted[2], done[2];
  CHECK_THAT(pipe(posted) == 0 && pipe(done) == 0, "pipe");
  pid_t stopper = fork();
  if (stopper == 0) {
    close(posted[1]);
    struct pollfd p = {posted[0], POLLIN, 0};
    char c;
    if (poll(&p, 1, 30000) == 1 && read(posted[0], &c, 1) == 1) kill(daemon, SIGTERM);
    _exit(0);
  }
  close(posted[0]);
  auto st = run_ranks(
      2,
      [&](Rank& r) {
        commd::Communicator comm = r.session.communicator(r.id, r.rank, r.nranks, 60s);
        if (r.rank == 1) {
          close(posted[1]);
          close(done[1]);
          char c;
          while (read(done[0], &c, 1) < 0 && errno == EINTR) {
          }
          return;
        }
        close(done[0]);
        commd::Buffer b = r.session.alloc_array<float>(4);
        commd::Request q = comm.recv_async<float>(b, 4, 1);  // rank 1 never sends
        CHECK_THAT(write(posted[1], "x", 1) == 1, "write");
        auto t1 = std::chrono::steady_clock::now();
        // The daemon completes every in-flight op with "shutting down" before it exits.
        auto e = expect_throw<commd::ShutdownError>("in-flight op at SIGTERM", [&] { q.wait(); });
        CHECK_THAT(contains(e.what(), "shutting down"), e.what());
        CHECK_THAT(seconds_since(t1) < 10, "took " << seconds_since(t1) << " s");
        // Then the session is gone.
        auto t2 = std::chrono::steady_clock::now();
        while (true) {
          try {
            comm.barrier();
            CHECK_THAT(false, "a barrier after shutdown succeeded");
          } catch (const commd::DaemonLostError&) {
            break;
          } catch (const commd::ShutdownError&) {
            // the daemon may still be closing sessions
            CHECK_THAT(seconds_since(t2) < 10, "still ShutdownError after 10 s");
            std::this_thread::sleep_for(50ms);
          }
        }
        CHECK_THAT(write(done[1], "x", 1) == 1, "write");
      },
      [&] {
        close(posted[1]);
        close(done[0]);
        close(done[1]);
      });
  waitpid(stopper, nullptr, 0);
  int ds = 0;
  waitpid(daemon, &ds, 0);
  if (!(WIFEXITED(ds) && WEXITSTATUS(ds) == 0)) fail("commd did not exit 0 after SIGTERM");
  test::expect_all_ok(st);
  std::string rm = std::string("rm -rf ") + dir;
  CHECK_THAT(std::system(rm.c_str()) == 0, "rm");
}

}  // namespace

int main(int argc, char** argv) {
  const std::map<std::string, void (*)()> cases = {
      {"missing-socket", missing_socket},
      {"invalid-arguments", invalid_arguments},
      {"mismatch", mismatch},
      {"peer-lost", peer_lost},
      {"op-timeout", op_timeout},
      {"join-timeout", join_timeout},
      {"requests", requests},
      {"bitwise", bitwise},
      {"threads", threads},
  };
  std::string name = argc > 1 ? argv[1] : "";
  try {
    if (name == "shutdown" && argc > 2) {
      shutdown(argv[2]);
    } else if (cases.count(name)) {
      cases.at(name)();
    } else {
      std::cerr << "usage: " << argv[0] << " CASE, one of: shutdown COMMD_BINARY";
      for (auto& c : cases) std::cerr << ", " << c.first;
      std::cerr << "\n";
      return 2;
    }
  } catch (const commd::Error& e) {
    std::cerr << name << ": FAILED: unexpected " << e.status_name() << ": " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << name << ": FAILED: " << e.what() << "\n";
    return 1;
  }
  std::cout << name << ": passed\n";
  return 0;
}
