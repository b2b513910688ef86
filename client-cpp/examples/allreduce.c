/*
 * allreduce.c: the commd C API end to end, with NRANKS real processes on one node.
 *
 *     allreduce [NRANKS] [SOCKET]     (defaults: 4 ranks, $COMMD_SOCKET or the default socket)
 *
 * The parent forks one process per rank (before any commd call: never fork a process that has
 * a commd session). Rank 0 gets the communicator's unique id and hands it to the other ranks
 * through pipes; a real job would pass it through its launcher (MPI, torchrun's store, a file).
 * Each rank runs all-reduce (out of place and in place), all-gather, broadcast, a nonblocking
 * reduce-scatter and a barrier, and checks every element. Exit status: 0 if every rank
 * verified every result, 1 otherwise.
 */
#define _POSIX_C_SOURCE 200809L
#include <commd.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_RANKS 64

/* Calls a commd function; on failure prints the status and message and exits this rank. */
#define CHECK(call)                                                                      \
  do {                                                                                   \
    commd_status_t s_ = (call);                                                          \
    if (s_ != COMMD_OK) {                                                                \
      fprintf(stderr, "rank %u: %s failed: %s: %s\n", rank, #call, commd_status_name(s_), \
              commd_last_error());                                                       \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

static unsigned rank;
static int failures;

static void expect_eq(const char* what, size_t i, double got, double want) {
  if (got != want) {
    if (failures < 10) {
      fprintf(stderr, "rank %u: %s[%zu] = %g, expected %g\n", rank, what, i, got, want);
    }
    failures++;
  }
}

static int read_full(int fd, void* p, size_t n) {
  char* c = p;
  while (n > 0) {
    ssize_t r = read(fd, c, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    c += r;
    n -= (size_t)r;
  }
  return 0;
}

static int run_rank(unsigned nranks, const char* socket, int uid_pipes[][2]) {
  commd_session_t* session = NULL;
  CHECK(commd_session_open(socket, &session));

  /* Rank 0 makes the id; the others read it from their pipe. */
  commd_unique_id_t id;
  if (rank == 0) {
    CHECK(commd_get_unique_id(session, &id));
    for (unsigned r = 1; r < nranks; r++) {
      if (write(uid_pipes[r][1], &id, sizeof id) != (ssize_t)sizeof id) {
        perror("write unique id");
        return 1;
      }
    }
  } else if (read_full(uid_pipes[rank][0], &id, sizeof id) != 0) {
    fprintf(stderr, "rank %u: rank 0 sent no unique id (did it fail?)\n", rank);
    return 1;
  }

  /* 30 s op and join timeouts: a broken run fails with a message instead of hanging. */
  commd_comm_t* comm = NULL;
  CHECK(commd_comm_init(session, &id, rank, nranks, 30000, 30000, &comm));

  /* 1. all-reduce, out of place: recv[i] = sum over ranks of (r + i). */
  const size_t n = 4096;
  commd_buffer_t *send = NULL, *recv = NULL;
  CHECK(commd_buffer_alloc(session, n * sizeof(float), &send));
  CHECK(commd_buffer_alloc(session, n * sizeof(float), &recv));
  float* s = commd_buffer_data(send);
  float* r = commd_buffer_data(recv);
  for (size_t i = 0; i < n; i++) s[i] = (float)(rank + i);
  CHECK(commd_all_reduce(comm, send, 0, recv, 0, n, COMMD_FLOAT32, COMMD_SUM, NULL));
  for (size_t i = 0; i < n; i++) {
    expect_eq("all_reduce sum", i, r[i], (double)nranks * i + nranks * (nranks - 1) / 2.0);
  }

  /* 2. all-reduce in place (same buffer and offset), int32 max, at a byte offset. */
  const size_t m = 1000, off = 64;
  commd_buffer_t* ints = NULL;
  CHECK(commd_buffer_alloc(session, off + m * sizeof(int32_t), &ints));
  int32_t* v = (int32_t*)((char*)commd_buffer_data(ints) + off);
  for (size_t i = 0; i < m; i++) v[i] = (int32_t)((rank * 7 + i) % 13);
  CHECK(commd_all_reduce(comm, ints, off, ints, off, m, COMMD_INT32, COMMD_MAX, NULL));
  for (size_t i = 0; i < m; i++) {
    int32_t want = 0;
    for (unsigned q = 0; q < nranks; q++) {
      int32_t x = (int32_t)((q * 7 + i) % 13);
      if (x > want) want = x;
    }
    expect_eq("all_reduce max", i, v[i], want);
  }

  /* 3. all-gather: each rank contributes 3 int64; block q of the result comes from rank q. */
  commd_buffer_t *mine = NULL, *all = NULL;
  CHECK(commd_buffer_alloc(session, 3 * sizeof(int64_t), &mine));
  CHECK(commd_buffer_alloc(session, 3 * nranks * sizeof(int64_t), &all));
  int64_t* g = commd_buffer_data(mine);
  for (int j = 0; j < 3; j++) g[j] = (int64_t)rank * 100 + j;
  CHECK(commd_all_gather(comm, mine, 0, all, 0, 3, COMMD_INT64, NULL));
  int64_t* ga = commd_buffer_data(all);
  for (unsigned q = 0; q < nranks; q++) {
    for (int j = 0; j < 3; j++) expect_eq("all_gather", q * 3 + j, (double)ga[q * 3 + j], q * 100.0 + j);
  }

  /* 4. broadcast from the last rank (only the root needs a send buffer). */
  const unsigned root = nranks - 1;
  commd_buffer_t* bc = NULL;
  CHECK(commd_buffer_alloc(session, 256 * sizeof(double), &bc));
  double* d = commd_buffer_data(bc);
  if (rank == root) {
    for (size_t i = 0; i < 256; i++) d[i] = 0.5 * i;
  }
  CHECK(commd_broadcast(comm, rank == root ? bc : NULL, 0, bc, 0, 256, COMMD_FLOAT64, root, NULL));
  for (size_t i = 0; i < 256; i++) expect_eq("broadcast", i, d[i], 0.5 * i);

  /* 5. nonblocking reduce-scatter: post, then wait on the request. Rank q gets block q of the
   *    element-wise sum; the buffers are not touched until the request completes. */
  const size_t per = 512;
  commd_buffer_t *rs_send = NULL, *rs_recv = NULL;
  CHECK(commd_buffer_alloc(session, per * nranks * sizeof(float), &rs_send));
  CHECK(commd_buffer_alloc(session, per * sizeof(float), &rs_recv));
  float* rs = commd_buffer_data(rs_send);
  for (size_t i = 0; i < per * nranks; i++) rs[i] = (float)(i % 97) + (float)rank;
  commd_request_t* req = NULL;
  CHECK(commd_reduce_scatter(comm, rs_send, 0, rs_recv, 0, per, COMMD_FLOAT32, COMMD_SUM, &req));
  commd_status_t st = commd_request_test(req); /* may or may not be done yet */
  if (st != COMMD_OK && st != COMMD_IN_PROGRESS) CHECK(st);
  CHECK(commd_request_wait(req));
  commd_request_free(req);
  float* rr = commd_buffer_data(rs_recv);
  for (size_t i = 0; i < per; i++) {
    size_t k = rank * per + i;
    expect_eq("reduce_scatter", i, rr[i], (double)nranks * (k % 97) + nranks * (nranks - 1) / 2.0);
  }

  /* 6. barrier, then clean up (any order: buffers and communicators keep the session alive). */
  CHECK(commd_barrier(comm, NULL));
  commd_session_close(session);
  commd_buffer_free(send);
  commd_buffer_free(recv);
  commd_buffer_free(ints);
  commd_buffer_free(mine);
  commd_buffer_free(all);
  commd_buffer_free(bc);
  commd_buffer_free(rs_send);
  commd_buffer_free(rs_recv);
  commd_comm_destroy(comm);

  if (failures) {
    fprintf(stderr, "rank %u: %d wrong elements\n", rank, failures);
    return 1;
  }
  printf("rank %u/%u: all results verified\n", rank, nranks);
  return 0;
}

int main(int argc, char** argv) {
  unsigned nranks = argc > 1 ? (unsigned)atoi(argv[1]) : 4;
  const char* socket = argc > 2 ? argv[2] : NULL;
  if (nranks < 1 || nranks > MAX_RANKS) {
    fprintf(stderr, "usage: %s [NRANKS (1..%d)] [SOCKET]\n", argv[0], MAX_RANKS);
    return 2;
  }
  if (strcmp(commd_version(), COMMD_VERSION) != 0) {
    fprintf(stderr, "libcommd %s does not match commd.h %s\n", commd_version(), COMMD_VERSION);
    return 2;
  }
  static int uid_pipes[MAX_RANKS][2];
  for (unsigned q = 0; q < nranks; q++) {
    if (pipe(uid_pipes[q]) != 0) {
      perror("pipe");
      return 2;
    }
  }
  fflush(stdout); /* the children must not inherit buffered output */
  pid_t pids[MAX_RANKS];
  for (unsigned q = 0; q < nranks; q++) {
    pids[q] = fork();
    if (pids[q] < 0) {
      perror("fork");
      return 2;
    }
    if (pids[q] == 0) {
      rank = q;
      /* Keep only what this rank uses, so a dead rank 0 shows up as EOF. */
      for (unsigned p = 0; p < nranks; p++) {
        if (p != q) close(uid_pipes[p][0]);
        if (q != 0) close(uid_pipes[p][1]);
      }
      int rc = run_rank(nranks, socket, uid_pipes);
      fflush(stdout);
      fflush(stderr);
      _exit(rc);
    }
  }
  for (unsigned q = 0; q < nranks; q++) {
    close(uid_pipes[q][0]);
    close(uid_pipes[q][1]);
  }
  int failed = 0;
  for (unsigned q = 0; q < nranks; q++) {
    int status = 0;
    if (waitpid(pids[q], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      fprintf(stderr, "rank %u failed (wait status %d)\n", q, status);
      failed = 1;
    }
  }
  printf(failed ? "FAILED\n" : "all %u ranks passed\n", nranks);
  return failed;
}
