// Test helpers: run a function in N forked rank processes that share a communicator, and
// check conditions with a message.
#ifndef COMMD_TEST_RANKS_HPP
#define COMMD_TEST_RANKS_HPP

#include <commd.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace test {

/// Thrown by CHECK_THAT; caught by run_ranks / main.
struct Failed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#define CHECK_THAT(cond, msg)                                                        \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::ostringstream os_;                                                        \
      os_ << __FILE__ << ":" << __LINE__ << ": " << #cond << " is false: " << msg;  \
      throw ::test::Failed(os_.str());                                               \
    }                                                                                \
  } while (0)

/// Runs `body` and checks that it throws exactly `E` (not a sibling class); returns it.
template <class E, class F>
E expect_throw(const char* what, F&& body) {
  try {
    body();
  } catch (const E& e) {
    return e;
  } catch (const commd::Error& e) {
    throw Failed(std::string(what) + ": expected " + typeid(E).name() + ", got " +
                 e.status_name() + ": " + e.what());
  }
  throw Failed(std::string(what) + ": expected " + typeid(E).name() + ", but nothing was thrown");
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// What one rank gets.
struct Rank {
  unsigned rank;
  unsigned nranks;
  commd::Session& session;
  const commd::UniqueId& id;
};

/// Forks `nranks` processes (call before this process opens any commd session). Each opens a
/// session ($COMMD_SOCKET), rank 0 makes a unique id and pipes it to the others, then runs
/// `body`; an exception or CHECK_THAT failure makes that rank exit 1 with the message.
/// `after_fork` runs in the parent once every rank is forked (e.g. to close pipe ends). Returns
/// each rank's wait status.
inline std::vector<int> run_ranks(unsigned nranks, const std::function<void(Rank&)>& body,
                                  const std::function<void()>& after_fork = {}) {
  std::vector<int> rd(nranks), wr(nranks);
  for (unsigned q = 0; q < nranks; q++) {
    int fds[2];
    if (pipe(fds) != 0) throw Failed("pipe failed");
    rd[q] = fds[0];
    wr[q] = fds[1];
  }
  std::cout.flush();
  std::cerr.flush();
  std::vector<pid_t> pids;
  for (unsigned q = 0; q < nranks; q++) {
    pid_t pid = fork();
    if (pid < 0) throw Failed("fork failed");
    if (pid == 0) {
      int rc = 1;
      try {
        for (unsigned p = 0; p < nranks; p++) {
          if (p != q) close(rd[p]);
          if (q != 0 || p == 0) close(wr[p]);
        }
        commd::Session session;
        commd::UniqueId id;
        if (q == 0) {
          id = session.unique_id();
          for (unsigned p = 1; p < nranks; p++) {
            if (write(wr[p], id.bytes(), id.size) != static_cast<ssize_t>(id.size)) {
              throw Failed("write unique id failed");
            }
          }
        } else {
          std::size_t got = 0;
          while (got < id.size) {
            ssize_t r = read(rd[q], id.bytes() + got, id.size - got);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) throw Failed("rank 0 sent no unique id");
            got += static_cast<std::size_t>(r);
          }
        }
        Rank rk{q, nranks, session, id};
        body(rk);
        rc = 0;
      } catch (const commd::Error& e) {
        std::cerr << "rank " << q << ": unexpected " << e.status_name() << ": " << e.what() << "\n";
      } catch (const std::exception& e) {
        std::cerr << "rank " << q << ": " << e.what() << "\n";
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
  if (after_fork) after_fork();
  std::vector<int> statuses(nranks);
  for (unsigned q = 0; q < nranks; q++) {
    while (waitpid(pids[q], &statuses[q], 0) < 0 && errno == EINTR) {
    }
  }
  return statuses;
}

inline bool exited_ok(int status) { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }

/// Checks that every rank exited 0.
inline void expect_all_ok(const std::vector<int>& st) {
  for (std::size_t q = 0; q < st.size(); q++) {
    CHECK_THAT(exited_ok(st[q]), "rank " << q << " failed (wait status " << st[q] << ")");
  }
}

}  // namespace test

#endif
