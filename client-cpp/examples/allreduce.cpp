// allreduce.cpp: the commd C++ wrapper (commd.hpp) end to end, with NRANKS real processes.
//
//     allreduce_cpp [NRANKS] [SOCKET]    (defaults: 4 ranks, $COMMD_SOCKET or the default socket)
//
// The parent forks one process per rank before any commd call (never fork a process that has a
// commd session). Rank 0 makes the communicator's unique id and hands it to the others as hex
// through pipes; a real job would pass it through its launcher. Each rank runs typed all-reduce
// (sum and average, blocking and nonblocking), reduce to a root, all-to-all, a send/recv ring
// and a barrier, and checks every element. Exit status 0 only if every rank verified everything.
#include <commd.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Checker {
  unsigned rank;
  int failures = 0;
  template <class A, class B>
  void eq(const char* what, std::size_t i, A got, B want) {
    if (got != static_cast<A>(want)) {
      if (failures < 10) {
        std::cerr << "rank " << rank << ": " << what << "[" << i << "] = " << got
                  << ", expected " << want << "\n";
      }
      failures++;
    }
  }
};

int run_rank(unsigned rank, unsigned nranks, const char* socket, int uid_in, std::vector<int>& uid_out) {
  commd::Session session(socket);

  // Rank 0 makes the id and writes it (as hex) to every other rank's pipe.
  commd::UniqueId id;
  if (rank == 0) {
    id = session.unique_id();
    std::string hex = id.to_hex();
    for (int fd : uid_out) {
      if (write(fd, hex.data(), hex.size()) != static_cast<ssize_t>(hex.size())) {
        std::perror("write unique id");
        return 1;
      }
    }
  } else {
    std::string hex(2 * commd::UniqueId::size, '\0');
    std::size_t got = 0;
    while (got < hex.size()) {
      ssize_t r = read(uid_in, &hex[got], hex.size() - got);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        std::cerr << "rank " << rank << ": rank 0 sent no unique id (did it fail?)\n";
        return 1;
      }
      got += static_cast<std::size_t>(r);
    }
    id = commd::UniqueId::from_hex(hex);
  }

  using std::chrono::seconds;
  commd::Communicator comm = session.communicator(id, rank, nranks, seconds(30), seconds(30));
  Checker check{comm.rank()};
  if (comm.size() != nranks) check.eq("size", 0, comm.size(), nranks);

  // 1. all-reduce sum of doubles, in place (send and recv are the same buffer).
  const std::size_t n = 10000;
  commd::Buffer x = session.alloc_array<double>(n);
  for (std::size_t i = 0; i < n; i++) x.as<double>()[i] = 0.25 * i + rank;
  comm.all_reduce<double>(x, x, n, commd::RedOp::Sum);
  for (std::size_t i = 0; i < n; i++) {
    check.eq("all_reduce sum", i, x.as<double>()[i], nranks * 0.25 * i + nranks * (nranks - 1) / 2.0);
  }

  // 2. nonblocking all-reduce average of floats into a second buffer, at an element offset.
  commd::Buffer a = session.alloc_array<float>(n);
  commd::Buffer avg = session.alloc_array<float>(n + 16);
  for (std::size_t i = 0; i < n; i++) a.as<float>()[i] = static_cast<float>(rank * 2);
  commd::Request req = comm.all_reduce_async<float>(a, avg.at_elem<float>(16), n, commd::RedOp::Avg);
  req.wait();  // a and avg stay untouched until here
  for (std::size_t i = 0; i < n; i++) {
    check.eq("all_reduce avg", i, avg.as<float>()[16 + i], static_cast<float>(nranks - 1));
  }

  // 3. reduce (product of int64) to root 0; the other ranks pass no recv buffer.
  commd::Buffer p = session.alloc_array<std::int64_t>(8);
  commd::Buffer prod = session.alloc_array<std::int64_t>(8);
  for (int i = 0; i < 8; i++) p.as<std::int64_t>()[i] = static_cast<std::int64_t>(rank) + i + 1;
  comm.reduce<std::int64_t>(p, rank == 0 ? commd::At(prod) : commd::At(), 8, commd::RedOp::Prod, 0);
  if (rank == 0) {
    for (int i = 0; i < 8; i++) {
      std::uint64_t want = 1;  // integer reductions wrap; unsigned arithmetic wraps the same way
      for (unsigned q = 0; q < nranks; q++) want *= static_cast<std::uint64_t>(q) + i + 1;
      check.eq("reduce prod", i, prod.as<std::int64_t>()[i], static_cast<std::int64_t>(want));
    }
  }

  // 4. all-to-all of int32: block q of rank r's send goes to block r of rank q's recv.
  const std::size_t per = 100;
  commd::Buffer s = session.alloc_array<std::int32_t>(per * nranks);
  commd::Buffer r = session.alloc_array<std::int32_t>(per * nranks);
  for (unsigned q = 0; q < nranks; q++) {
    for (std::size_t i = 0; i < per; i++) s.as<std::int32_t>()[q * per + i] = static_cast<std::int32_t>(rank * 10000 + q * 100 + i);
  }
  comm.all_to_all<std::int32_t>(s, r, per);
  for (unsigned q = 0; q < nranks; q++) {
    for (std::size_t i = 0; i < per; i++) {
      check.eq("all_to_all", q * per + i, r.as<std::int32_t>()[q * per + i], q * 10000 + rank * 100 + i);
    }
  }

  // 5. a ring: send to the right neighbour, receive from the left, both nonblocking.
  if (nranks > 1) {
    commd::Buffer out = session.alloc_array<std::uint8_t>(64);
    commd::Buffer in = session.alloc_array<std::uint8_t>(64);
    for (int i = 0; i < 64; i++) out.as<std::uint8_t>()[i] = static_cast<std::uint8_t>(rank + i);
    unsigned right = (rank + 1) % nranks, left = (rank + nranks - 1) % nranks;
    commd::Request sr = comm.send_async<std::uint8_t>(out, 64, right);
    commd::Request rr = comm.recv_async<std::uint8_t>(in, 64, left);
    rr.wait();
    sr.wait();
    for (int i = 0; i < 64; i++) check.eq("ring recv", i, +in.as<std::uint8_t>()[i], (left + i) & 0xff);
  }

  comm.barrier();
  if (check.failures) {
    std::cerr << "rank " << rank << ": " << check.failures << " wrong elements\n";
    return 1;
  }
  std::cout << "rank " << rank << "/" << nranks << ": all results verified\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  unsigned nranks = argc > 1 ? static_cast<unsigned>(std::atoi(argv[1])) : 4;
  const char* socket = argc > 2 ? argv[2] : nullptr;
  if (nranks < 1 || nranks > 64) {
    std::cerr << "usage: " << argv[0] << " [NRANKS (1..64)] [SOCKET]\n";
    return 2;
  }
  if (std::string(commd::version()) != COMMD_VERSION) {
    std::cerr << "libcommd " << commd::version() << " does not match commd.h " << COMMD_VERSION << "\n";
    return 2;
  }
  std::vector<int> rd(nranks), wr(nranks);
  for (unsigned q = 0; q < nranks; q++) {
    int fds[2];
    if (pipe(fds) != 0) {
      std::perror("pipe");
      return 2;
    }
    rd[q] = fds[0];
    wr[q] = fds[1];
  }
  std::cout.flush();
  std::vector<pid_t> pids;
  for (unsigned q = 0; q < nranks; q++) {
    pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork");
      return 2;
    }
    if (pid == 0) {
      std::vector<int> outs;
      for (unsigned p = 0; p < nranks; p++) {
        if (p != q) close(rd[p]);
        if (q == 0 && p != 0) outs.push_back(wr[p]);
        else close(wr[p]);
      }
      int rc = 1;
      try {
        rc = run_rank(q, nranks, socket, rd[q], outs);
      } catch (const commd::Error& e) {
        std::cerr << "rank " << q << ": " << e.status_name() << ": " << e.what() << "\n";
      }
      std::cout.flush();
      std::cerr.flush();
      _exit(rc);
    }
    pids.push_back(pid);
  }
  for (unsigned q = 0; q < nranks; q++) {
    close(rd[q]);
    close(wr[q]);
  }
  int failed = 0;
  for (unsigned q = 0; q < nranks; q++) {
    int status = 0;
    if (waitpid(pids[q], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::cerr << "rank " << q << " failed (wait status " << status << ")\n";
      failed = 1;
    }
  }
  std::cout << (failed ? "FAILED" : "all ranks passed") << "\n";
  return failed;
}
