/* One rank of a job written against NCCL's C API, run on commd's libnccl.so.2 with host
 * buffers (the library's host-memory extension), so it runs on machines without GPUs.
 *
 *   nccl_host RANK NRANKS DIR MODE
 *
 * DIR holds the unique ids rank 0 publishes. MODE:
 *   ops   every collective, dtype and op mapping, groups, gather/scatter, split, non-blocking
 *         init, and the error paths; prints "OK" when every check passed.
 *   kill  the last rank exits without a word after the first op; the others must get
 *         ncclRemoteError from their next op and from ncclCommGetAsyncError, never hang.
 *   shrink  the last rank exits after the first op; the others get ncclRemoteError, shrink
 *         without it (ncclCommShrink, NCCL_SHRINK_ABORT on rank 0, default on the others) and
 *         all-reduce on the child; then rank 0 revokes the child (ncclCommRevoke), every rank's
 *         next op fails, and they shrink the revoked child with an empty list; the error paths
 *         of both calls.
 */
#include <nccl.h>

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Declared by NCCL's own nccl.h (every call's profiling alias) and nccl_device/host.h (the
 * device API's host side), which commd's nccl.h leaves out. */
ncclResult_t pncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                            ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                            cudaStream_t stream);
typedef struct {
  int nRanks, rank, stride;
} ncclTeam_t;
ncclTeam_t ncclTeamWorld(ncclComm_t comm);
ncclTeam_t ncclTeamLsa(ncclComm_t comm);
int ncclTeamRankToWorld(ncclComm_t comm, ncclTeam_t team, int rank);
ncclResult_t ncclLsaBarrierCreateRequirement(ncclTeam_t team, int nBarriers, void* outHandle,
                                             void* outReq);

static int rank, nranks;

#define FAIL(...)                                   \
  do {                                              \
    fprintf(stderr, "rank %d: FAIL line %d: ", rank, __LINE__); \
    fprintf(stderr, __VA_ARGS__);                   \
    fprintf(stderr, "\n");                          \
    exit(1);                                        \
  } while (0)

#define NCCL(call)                                                                    \
  do {                                                                                \
    ncclResult_t r_ = (call);                                                         \
    if (r_ != ncclSuccess)                                                            \
      FAIL("%s -> %d (%s): %s", #call, r_, ncclGetErrorString(r_), ncclGetLastError(NULL)); \
  } while (0)

#define EXPECT_ERR(code, call, text)                                                   \
  do {                                                                                 \
    ncclResult_t r_ = (call);                                                          \
    const char* m_ = ncclGetLastError(NULL);                                           \
    if (r_ != (code)) FAIL("%s -> %d, expected %d (%s)", #call, r_, (code), m_);        \
    if (!strstr(m_, (text))) FAIL("%s: message '%s' lacks '%s'", #call, m_, (text));    \
  } while (0)

static void publish_or_read(const char* dir, const char* name, ncclUniqueId* id) {
  char path[4096], tmp[4200];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  if (rank == 0) {
    NCCL(ncclGetUniqueId(id));
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE* f = fopen(tmp, "wb");
    if (!f || fwrite(id, sizeof *id, 1, f) != 1 || fclose(f) != 0) FAIL("write %s", tmp);
    if (rename(tmp, path) != 0) FAIL("rename %s: %s", path, strerror(errno));
    return;
  }
  for (int i = 0; i < 3000; i++) {
    FILE* f = fopen(path, "rb");
    if (f) {
      size_t n = fread(id, sizeof *id, 1, f);
      fclose(f);
      if (n == 1) return;
    }
    usleep(10000);
  }
  FAIL("no unique id at %s", path);
}

static ncclComm_t init(const char* dir, const char* name) {
  ncclUniqueId id;
  ncclComm_t c = NULL;
  publish_or_read(dir, name, &id);
  NCCL(ncclCommInitRank(&c, nranks, id, rank));
  return c;
}

static void ops(ncclComm_t comm, const char* dir) {
  enum { N = 1000 };
  int v = 0, n = 0, r = -1, dev = -1;
  NCCL(ncclGetVersion(&v));
  if (v < 22800) FAIL("version %d", v);
  NCCL(ncclCommCount(comm, &n));
  NCCL(ncclCommUserRank(comm, &r));
  NCCL(ncclCommCuDevice(comm, &dev));
  if (n != nranks || r != rank || dev < 0) FAIL("count %d rank %d dev %d", n, r, dev);

  /* memory statistics: what the library holds cannot be suspended (total = persistent) */
  uint64_t ms[4];
  for (int k = 0; k < 4; k++) {
    ms[k] = 77;
    NCCL(ncclCommMemStats(comm, (ncclCommMemStat_t)k, &ms[k]));
  }
  if (ms[ncclStatGpuMemTotal] != ms[ncclStatGpuMemPersist] || ms[ncclStatGpuMemSuspend] != 0 ||
      ms[ncclStatGpuMemSuspended] != 0)
    FAIL("memstats: suspend %llu suspended %llu persist %llu total %llu",
         (unsigned long long)ms[0], (unsigned long long)ms[1], (unsigned long long)ms[2],
         (unsigned long long)ms[3]);
  EXPECT_ERR(ncclInvalidArgument, ncclCommMemStats(comm, (ncclCommMemStat_t)4, &ms[0]),
             "unknown memory statistic");

  /* all-reduce: float sum out of place, in place, avg; int32 max; uint32 sum wrapping */
  float fs[N], fr[N];
  for (int i = 0; i < N; i++) fs[i] = (float)(rank + i);
  NCCL(ncclAllReduce(fs, fr, N, ncclFloat, ncclSum, comm, NULL));
  for (int i = 0; i < N; i++) {
    float want = (float)(nranks * (nranks - 1) / 2 + nranks * i);
    if (fr[i] != want) FAIL("allreduce sum [%d] = %f, want %f", i, fr[i], want);
  }
  NCCL(ncclAllReduce(fs, fs, N, ncclFloat, ncclAvg, comm, NULL));
  for (int i = 0; i < N; i++) {
    float want = (float)(nranks - 1) / 2.0f + (float)i;
    if (fs[i] != want) FAIL("allreduce avg in place [%d] = %f, want %f", i, fs[i], want);
  }
  int32_t is[N], ir[N];
  for (int i = 0; i < N; i++) is[i] = (i % nranks == rank) ? 1000 + i : -i;
  NCCL(ncclAllReduce(is, ir, N, ncclInt32, ncclMax, comm, NULL));
  for (int i = 0; i < N; i++)
    if (ir[i] != 1000 + i) FAIL("allreduce max [%d] = %d", i, ir[i]);
  uint32_t us[N], ur[N];
  for (int i = 0; i < N; i++) us[i] = 0xfffffff0u + (uint32_t)i;
  NCCL(ncclAllReduce(us, ur, N, ncclUint32, ncclSum, comm, NULL));
  for (int i = 0; i < N; i++)
    if (ur[i] != (uint32_t)(nranks * (0xfffffff0u + (uint32_t)i)))
      FAIL("uint32 sum [%d] = %u", i, ur[i]);
  /* unsigned min/max/avg compare and divide unsigned (as signed, 0xfffffff0 would be -16) */
  for (int i = 0; i < N; i++) us[i] = (i % nranks == rank) ? 0xfffffff0u : 5u;
  NCCL(ncclAllReduce(us, ur, N, ncclUint32, ncclMax, comm, NULL));
  for (int i = 0; i < N; i++)
    if (ur[i] != 0xfffffff0u) FAIL("uint32 max [%d] = %u", i, ur[i]);
  NCCL(ncclAllReduce(us, ur, N, ncclUint32, ncclMin, comm, NULL));
  for (int i = 0; i < N; i++)
    if (ur[i] != (nranks == 1 ? 0xfffffff0u : 5u)) FAIL("uint32 min [%d] = %u", i, ur[i]);
  /* avg as NCCL defines it: the sum wrapped in the type, then divided (unsigned) */
  for (int i = 0; i < N; i++) us[i] = rank == 0 ? 0xfffffff0u + (uint32_t)i : 1u;
  NCCL(ncclAllReduce(us, ur, N, ncclUint32, ncclAvg, comm, NULL));
  for (int i = 0; i < N; i++)
    if (ur[i] != (uint32_t)(0xfffffff0u + (uint32_t)i + (uint32_t)(nranks - 1)) / (uint32_t)nranks)
      FAIL("uint32 avg [%d] = %u", i, ur[i]);
  uint64_t qs[N], qr[N];
  for (int i = 0; i < N; i++) qs[i] = rank == 0 ? UINT64_MAX - (uint64_t)i : 1u;
  NCCL(ncclAllReduce(qs, qr, N, ncclUint64, ncclAvg, comm, NULL));
  for (int i = 0; i < N; i++) {
    uint64_t want = (UINT64_MAX - (uint64_t)i + (uint64_t)(nranks - 1)) / (uint64_t)nranks;
    if (qr[i] != want) FAIL("uint64 avg [%d] = %llu", i, (unsigned long long)qr[i]);
  }
  /* signed: (100 + 100 + ...) wraps in int8 before the division */
  {
    int8_t bs = 100, br = 0;
    NCCL(ncclAllReduce(&bs, &br, 1, ncclInt8, ncclAvg, comm, NULL));
    if (br != (int8_t)((int8_t)(100 * nranks) / nranks)) FAIL("int8 avg %d", br);
  }
  NCCL(ncclAllReduce(qs, qr, N, ncclUint64, ncclMax, comm, NULL));
  for (int i = 0; i < N; i++)
    if (qr[i] != UINT64_MAX - (uint64_t)i) FAIL("uint64 max [%d]", i);

  /* fp8, as codes: E4M3 1.0 is 0x38, 256 is 0x78, largest 448 is 0x7E, NaN 0x7F; E5M2 32768 is
   * 0x78, largest 57344 0x7B. Sums accumulate in float32 and store saturated. */
  uint8_t f8s[4], f8r[4];
  f8s[0] = 0x38;                   /* 1.0 each: the sum is nranks */
  f8s[1] = 0x78;                   /* 256 each: saturates from 2 ranks */
  f8s[2] = rank == 0 ? 0x7F : 0x38; /* a NaN stays NaN */
  f8s[3] = rank == 0 ? 0x38 : 0xB8; /* max of 1.0 and -1.0 */
  NCCL(ncclAllReduce(f8s, f8r, 3, ncclFloat8e4m3, ncclSum, comm, NULL));
  {
    int e = 0;
    while ((2 << e) <= nranks) e++;
    int want = nranks <= 16 ? (((e + 7) << 3) | ((nranks - (1 << e)) << 3 >> e)) : -1;
    if (want >= 0 && f8r[0] != want) FAIL("fp8 e4m3 sum = %#x, want %#x", f8r[0], want);
    if (f8r[1] != (nranks == 1 ? 0x78 : 0x7E)) FAIL("fp8 e4m3 saturation = %#x", f8r[1]);
    if ((f8r[2] & 0x7F) != 0x7F) FAIL("fp8 e4m3 NaN = %#x", f8r[2]);
  }
  NCCL(ncclAllReduce(f8s + 3, f8r + 3, 1, ncclFloat8e4m3, ncclMax, comm, NULL));
  if (f8r[3] != 0x38) FAIL("fp8 e4m3 max = %#x", f8r[3]);
  f8s[0] = 0x78; /* E5M2 32768 */
  NCCL(ncclAllReduce(f8s, f8r, 1, ncclFloat8e5m2, ncclSum, comm, NULL));
  if (f8r[0] != (nranks == 1 ? 0x78 : 0x7B)) FAIL("fp8 e5m2 saturation = %#x", f8r[0]);

  /* broadcast from the last rank (out of place, then in place with ncclBcast) */
  int root = nranks - 1;
  double ds[N], dr[N];
  for (int i = 0; i < N; i++) ds[i] = rank == root ? 0.5 * i : -1.0;
  NCCL(ncclBroadcast(ds, dr, N, ncclDouble, root, comm, NULL));
  NCCL(ncclBcast(ds, N, ncclDouble, root, comm, NULL));
  for (int i = 0; i < N; i++)
    if (dr[i] != 0.5 * i || ds[i] != 0.5 * i) FAIL("broadcast [%d] = %f/%f", i, dr[i], ds[i]);

  /* reduce (prod, int64) to rank 0 */
  int64_t ls[8], lr[8];
  for (int i = 0; i < 8; i++) ls[i] = rank + 2;
  memset(lr, 0, sizeof lr);
  NCCL(ncclReduce(ls, lr, 8, ncclInt64, ncclProd, 0, comm, NULL));
  if (rank == 0) {
    int64_t want = 1;
    for (int q = 0; q < nranks; q++) want *= q + 2;
    for (int i = 0; i < 8; i++)
      if (lr[i] != want) FAIL("reduce prod [%d] = %lld", i, (long long)lr[i]);
  }

  /* all-gather (int8), reduce-scatter (double), all-to-all (int32) */
  int8_t gs[16], *gr = malloc(16 * nranks);
  for (int i = 0; i < 16; i++) gs[i] = (int8_t)(rank * 16 + i);
  NCCL(ncclAllGather(gs, gr, 16, ncclInt8, comm, NULL));
  for (int i = 0; i < 16 * nranks; i++)
    if (gr[i] != (int8_t)i) FAIL("allgather [%d] = %d", i, gr[i]);
  double* rs = malloc(sizeof(double) * 4 * nranks);
  double rr[4];
  for (int i = 0; i < 4 * nranks; i++) rs[i] = i + rank;
  NCCL(ncclReduceScatter(rs, rr, 4, ncclDouble, ncclSum, comm, NULL));
  for (int i = 0; i < 4; i++) {
    double want = nranks * (double)(rank * 4 + i) + nranks * (nranks - 1) / 2.0;
    if (rr[i] != want) FAIL("reducescatter [%d] = %f, want %f", i, rr[i], want);
  }
  int32_t* as = malloc(sizeof(int32_t) * 2 * nranks);
  int32_t* ar = malloc(sizeof(int32_t) * 2 * nranks);
  for (int p = 0; p < nranks; p++)
    for (int j = 0; j < 2; j++) as[p * 2 + j] = rank * 100 + p * 10 + j;
  NCCL(ncclAlltoAll(as, ar, 2, ncclInt32, comm, NULL));
  for (int p = 0; p < nranks; p++)
    for (int j = 0; j < 2; j++)
      if (ar[p * 2 + j] != p * 100 + rank * 10 + j) FAIL("alltoall [%d]", p * 2 + j);

  /* a ring of send/recv in one group, receives first on odd ranks (would deadlock unbatched) */
  int right = (rank + 1) % nranks, left = (rank + nranks - 1) % nranks;
  int32_t sv[64], rv[64];
  for (int i = 0; i < 64; i++) sv[i] = rank * 1000 + i;
  NCCL(ncclGroupStart());
  if (rank % 2) NCCL(ncclRecv(rv, 64, ncclInt32, left, comm, NULL));
  NCCL(ncclSend(sv, 64, ncclInt32, right, comm, NULL));
  if (!(rank % 2)) NCCL(ncclRecv(rv, 64, ncclInt32, left, comm, NULL));
  NCCL(ncclGroupEnd());
  for (int i = 0; i < 64; i++)
    if (rv[i] != left * 1000 + i) FAIL("ring recv [%d] = %d", i, rv[i]);

  /* gather to rank 0, scatter back from it */
  int32_t mine[3] = {rank, rank * 2, rank * 3}, back[3];
  int32_t* all = malloc(sizeof(int32_t) * 3 * nranks);
  NCCL(ncclGather(mine, all, 3, ncclInt32, 0, comm, NULL));
  if (rank == 0)
    for (int p = 0; p < nranks; p++)
      if (all[p * 3] != p || all[p * 3 + 2] != 3 * p) FAIL("gather from %d", p);
  if (rank == 0)
    for (int i = 0; i < 3 * nranks; i++) all[i] = 7 * i;
  NCCL(ncclScatter(all, back, 3, ncclInt32, 0, comm, NULL));
  for (int i = 0; i < 3; i++)
    if (back[i] != 7 * (rank * 3 + i)) FAIL("scatter [%d] = %d", i, back[i]);

  /* split by parity, reversed order within each color; rank 0 opts out of a second split */
  ncclComm_t sub = NULL;
  NCCL(ncclCommSplit(comm, rank % 2, -rank, &sub, NULL));
  int sn = 0, sr = 0, members = 0, pos = 0;
  for (int q = 0; q < nranks; q++)
    if (q % 2 == rank % 2) {
      members++;
      if (q > rank) pos++;
    }
  NCCL(ncclCommCount(sub, &sn));
  NCCL(ncclCommUserRank(sub, &sr));
  if (sn != members || sr != pos) FAIL("split: %d of %d, want %d of %d", sr, sn, pos, members);
  int32_t one = rank, sum = 0, want = 0;
  for (int q = rank % 2; q < nranks; q += 2) want += q;
  NCCL(ncclAllReduce(&one, &sum, 1, ncclInt32, ncclSum, sub, NULL));
  if (sum != want) FAIL("split allreduce %d, want %d", sum, want);
  NCCL(ncclCommDestroy(sub));
  ncclComm_t none = (ncclComm_t)0x1;
  NCCL(ncclCommSplit(comm, rank == 0 ? NCCL_SPLIT_NOCOLOR : 1, 0, &none, NULL));
  if (rank == 0 && none != NULL) FAIL("NOCOLOR split gave a communicator");
  if (rank != 0) {
    NCCL(ncclCommCount(none, &sn));
    if (sn != nranks - 1) FAIL("second split has %d ranks", sn);
    NCCL(ncclCommDestroy(none));
  }

  /* a split that fails leaves NCCL_COMM_NULL behind, as NCCL's */
  ncclComm_t junk = (ncclComm_t)0x1;
  EXPECT_ERR(ncclInvalidArgument, ncclCommSplit(comm, -5, 0, &junk, NULL), "color -5");
  if (junk != NULL) FAIL("a failed split left %p in newcomm", (void*)junk);

  /* a non-blocking communicator: in progress until joined, unusable until then (as NCCL:
     ncclInvalidArgument), then usable; a config whose blocking is neither 0 nor 1 refused */
  ncclUniqueId id2;
  publish_or_read(dir, "id-nonblocking", &id2);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 7;
  ncclComm_t nb = NULL;
  EXPECT_ERR(ncclInvalidArgument, ncclCommInitRankConfig(&nb, nranks, id2, rank, &cfg),
             "blocking attribute 7");
  cfg.blocking = 0;
  /* fields commd cannot apply (said once on stderr), its name (in the INIT line), a split
     share (what commd always does) */
  cfg.maxCTAs = 8;
  cfg.commName = "nonblocking-test";
  cfg.splitShare = 1;
  if (rank != 0) usleep(300000); /* rank 0's join waits for the others meanwhile */
  ncclResult_t ir0 = ncclCommInitRankConfig(&nb, nranks, id2, rank, &cfg);
  if (ir0 != ncclSuccess && ir0 != ncclInProgress) FAIL("non-blocking init -> %d", ir0);
  if (rank == 0) {
    if (ir0 != ncclInProgress) FAIL("non-blocking init of rank 0 alone -> %d", ir0);
    EXPECT_ERR(ncclInvalidArgument, ncclAllReduce(&one, &sum, 1, ncclInt32, ncclSum, nb, NULL),
               "before its initialisation finished");
  }
  ncclResult_t st = ncclInProgress;
  for (int i = 0; i < 10000 && st == ncclInProgress; i++) {
    NCCL(ncclCommGetAsyncError(nb, &st));
    if (st == ncclInProgress) usleep(1000);
  }
  if (st != ncclSuccess) FAIL("non-blocking init ended with %d", st);
  NCCL(ncclAllReduce(&one, &sum, 1, ncclInt32, ncclSum, nb, NULL));
  if (sum != nranks * (nranks - 1) / 2) FAIL("non-blocking comm allreduce %d", sum);
  NCCL(ncclCommAbort(nb));

  /* error paths: each a clear code and message, nothing posted */
  EXPECT_ERR(ncclInvalidArgument, ncclAllReduce(fs, fr, N, (ncclDataType_t)42, ncclSum, comm, NULL),
             "data type 42");
  EXPECT_ERR(ncclInvalidArgument, ncclBroadcast(ds, dr, N, ncclDouble, nranks, comm, NULL),
             "out of range");
  EXPECT_ERR(ncclInvalidArgument, ncclAllReduce(NULL, fr, N, ncclFloat, ncclSum, comm, NULL),
             "sendbuff is NULL");
  /* PreMulSum: each rank scales its own input by its own scalar, then the sum (nccl-tests'
     -o mulsum gives each rank another scalar and destroys the op right after enqueuing). */
  ncclRedOp_t pm;
  float scalar = (float)(rank + 1);
  NCCL(ncclRedOpCreatePreMulSum(&pm, &scalar, ncclFloat, ncclScalarHostImmediate, comm));
  scalar = 100.0f; /* the immediate was read at creation */
  for (int i = 0; i < N; i++) fs[i] = (float)i;
  NCCL(ncclAllReduce(fs, fr, N, ncclFloat, pm, comm, NULL));
  NCCL(ncclRedOpDestroy(pm, comm));
  for (int i = 0; i < N; i++) {
    float want = (float)i * (float)(nranks * (nranks + 1) / 2);
    if (fr[i] != want) FAIL("premulsum allreduce [%d] = %f, want %f", i, fr[i], want);
    if (fs[i] != (float)i) FAIL("premulsum changed the send buffer [%d] = %f", i, fs[i]);
  }
  int64_t pms = 3 - rank, pml[4 * 8], pmr[4];
  for (int i = 0; i < 4 * nranks && i < 32; i++) pml[i] = i;
  ncclRedOp_t pm2;
  NCCL(ncclRedOpCreatePreMulSum(&pm2, &pms, ncclInt64, ncclScalarHostImmediate, comm));
  NCCL(ncclReduceScatter(pml, pmr, 4, ncclInt64, pm2, comm, NULL));
  {
    int64_t sum_s = 0;
    for (int r = 0; r < nranks; r++) sum_s += 3 - r;
    for (int i = 0; i < 4; i++)
      if (pmr[i] != (int64_t)(rank * 4 + i) * sum_s)
        FAIL("premulsum reducescatter [%d] = %lld", i, (long long)pmr[i]);
  }
  EXPECT_ERR(ncclInvalidArgument, ncclAllReduce(fs, fr, N, ncclFloat, pm2, comm, NULL),
             "created for ncclInt64");
  NCCL(ncclRedOpDestroy(pm2, comm));
  EXPECT_ERR(ncclInvalidArgument, ncclAllReduce(fs, fr, N, ncclFloat, pm2, comm, NULL),
             "not one ncclRedOpCreatePreMulSum created");
  EXPECT_ERR(ncclInvalidArgument, ncclRedOpDestroy(pm2, comm), "already destroyed");
  EXPECT_ERR(ncclInvalidArgument,
             ncclRedOpCreatePreMulSum(&pm, &scalar, ncclFloat, (ncclScalarResidence_t)5, comm),
             "residence 5");
  NCCL(ncclRedOpCreatePreMulSum(&pm, &scalar, ncclFloat, ncclScalarDevice, comm));
  EXPECT_ERR(ncclInvalidUsage, ncclAllReduce(fs, fr, N, ncclFloat, pm, comm, NULL),
             "ncclScalarDevice");
  NCCL(ncclRedOpDestroy(pm, comm));
  EXPECT_ERR(ncclInvalidUsage, ncclGroupEnd(), "without a matching ncclGroupStart");

  /* a failed call inside a group returns its error; the group's valid ops still run, nested
     groups included, and ncclGroupEnd does not repeat the error (NCCL's does: torch's group
     guard checks ncclGroupEnd in its destructor, which would then throw while the call's
     exception unwinds, and abort the process) */
  sum = -1;
  NCCL(ncclGroupStart());
  NCCL(ncclGroupStart());
  NCCL(ncclAllReduce(&one, &sum, 1, ncclInt32, ncclSum, comm, NULL));
  EXPECT_ERR(ncclInvalidArgument, ncclAllReduce(fs, fr, N, (ncclDataType_t)42, ncclSum, comm, NULL),
             "data type 42");
  NCCL(ncclGroupEnd());
  NCCL(ncclGroupEnd());
  if (sum != nranks * (nranks - 1) / 2) FAIL("the group's valid allreduce gave %d", sum);

  /* the root's buffers of a gather/scatter are checked before anything is copied or posted
     (only the root calls: nothing reaches the others) */
  if (rank == 0) {
    EXPECT_ERR(ncclInvalidArgument, ncclGather(mine, NULL, 3, ncclInt32, 0, comm, NULL),
               "recvbuff is NULL at the root");
    EXPECT_ERR(ncclInvalidArgument, ncclGather(NULL, all, 3, ncclInt32, 0, comm, NULL),
               "sendbuff is NULL at the root");
    EXPECT_ERR(ncclInvalidArgument, ncclScatter(NULL, back, 3, ncclInt32, 0, comm, NULL),
               "sendbuff is NULL at the root");
    EXPECT_ERR(ncclInvalidArgument,
               ncclGather(mine, all, (size_t)1 << 50, ncclInt32, 0, comm, NULL), "too large");
  }

  /* registration handles: one deregistration each; a stale or made-up handle is refused */
  void* reg = NULL;
  NCCL(ncclCommRegister(comm, fs, sizeof fs, &reg));
  if (reg == NULL) FAIL("ncclCommRegister gave a NULL handle");
  NCCL(ncclCommDeregister(comm, reg));
  EXPECT_ERR(ncclInvalidUsage, ncclCommDeregister(comm, reg), "not a live registration");
  EXPECT_ERR(ncclInvalidUsage, ncclCommDeregister(comm, (void*)0x1234), "not a live registration");

  /* ncclCommInitAll checks its device list before joining anything */
  ncclComm_t ia[2];
  int bad[2] = {0, -1};
  EXPECT_ERR(ncclInvalidArgument, ncclCommInitAll(ia, 2, bad), "invalid device -1");
  ncclResult_t ae = ncclInternalError;
  NCCL(ncclCommGetAsyncError(comm, &ae));
  if (ae != ncclSuccess) FAIL("async error %d after the checks", ae);

  /* per-collective config (NCCL 2.32's nccl*Config): NULL is the plain call; an uninitialized
   * struct, an unknown or forced algorithm selection, and CTA limits commd cannot keep are
   * refused with NCCL's codes; fields that bound nothing commd runs are accepted */
  {
    int32_t v1 = rank + 1, got = 0, want = nranks * (nranks + 1) / 2;
    ncclCollConfig_t cc = NCCL_COLLCONFIG_INITIALIZER, init = NCCL_COLLCONFIG_INITIALIZER, zero;
    if (cc.size != 72 || cc.magic != NCCL_API_MAGIC || cc.forceAlgSelection != 1)
      FAIL("initializer: size %zu magic %#x force %d", cc.size, cc.magic, cc.forceAlgSelection);
    NCCL(ncclAllReduceConfig(&v1, &got, 1, ncclInt32, ncclSum, comm, NULL, NULL));
    if (got != want) FAIL("AllReduceConfig(NULL) %d, want %d", got, want);
    got = 0;
    NCCL(ncclAllReduceConfig(&v1, &got, 1, ncclInt32, ncclSum, comm, NULL, &cc));
    if (got != want) FAIL("AllReduceConfig %d, want %d", got, want);
    memset(&zero, 0, sizeof zero);
    EXPECT_ERR(ncclInvalidArgument, ncclAllReduceConfig(&v1, &got, 1, ncclInt32, ncclSum, comm, NULL, &zero),
               "not initialized");
    cc.algSelection = "ring";
    EXPECT_ERR(ncclInvalidArgument, ncclAllReduceConfig(&v1, &got, 1, ncclInt32, ncclSum, comm, NULL, &cc),
               "cannot be honored");
    cc.forceAlgSelection = 0;
    got = 0;
    NCCL(ncclAllReduceConfig(&v1, &got, 1, ncclInt32, ncclSum, comm, NULL, &cc));
    if (got != want) FAIL("AllReduceConfig, unforced selection: %d, want %d", got, want);
    cc.algSelection = "ring+tree";
    EXPECT_ERR(ncclInvalidArgument, ncclAllReduceConfig(&v1, &got, 1, ncclInt32, ncclSum, comm, NULL, &cc),
               "matches no algorithm");
    cc = init;
    cc.forceAlgSelection = 3;
    EXPECT_ERR(ncclInvalidArgument, ncclAllReduceConfig(&v1, &got, 1, ncclInt32, ncclSum, comm, NULL, &cc),
               "forceAlgSelection");
    cc = init;
    cc.maxCTAs = 8;
    EXPECT_ERR(ncclInvalidUsage, ncclAllReduceConfig(&v1, &got, 1, ncclInt32, ncclSum, comm, NULL, &cc),
               "maxCTAs=8");
    cc = init;
    cc.CTAPolicy = NCCL_CTA_POLICY_ZERO;
    EXPECT_ERR(ncclInvalidUsage, ncclBroadcastConfig(&v1, &got, 1, ncclInt32, 0, comm, NULL, &cc),
               "CTAPolicy");
    cc.CTAPolicy = 9;
    EXPECT_ERR(ncclInvalidArgument, ncclBroadcastConfig(&v1, &got, 1, ncclInt32, 0, comm, NULL, &cc),
               "CTAPolicy 9");
    /* bound nothing commd runs, or out of NCCL's range (which NCCL ignores too) */
    cc = init;
    cc.nvlsCTAs = 4;
    cc.cgaClusterSize = 2;
    cc.maxCTAs = 0;
    cc.userProfilerTag = 0x1234;
    cc.CTAPolicy = NCCL_CTA_POLICY_DEFAULT;
    int32_t b = rank == 0 ? 77 : 0;
    NCCL(ncclBroadcastConfig(&b, &b, 1, ncclInt32, 0, comm, NULL, &cc));
    if (b != 77) FAIL("BroadcastConfig %d", b);
    /* a 2.31 struct (no launchCompletionEvent) */
    cc = init;
    cc.size = 64;
    got = -1;
    NCCL(ncclReduceConfig(&v1, &got, 1, ncclInt32, ncclSum, 0, comm, NULL, &cc));
    if (rank == 0 && got != want) FAIL("ReduceConfig %d, want %d", got, want);
    int32_t *ag = calloc(nranks, sizeof *ag), *aa = calloc(nranks, sizeof *aa);
    int32_t *ab = calloc(nranks, sizeof *ab);
    NCCL(ncclAllGatherConfig(&v1, ag, 1, ncclInt32, comm, NULL, &init));
    for (int i = 0; i < nranks; i++)
      if (ag[i] != i + 1) FAIL("AllGatherConfig [%d] = %d", i, ag[i]);
    for (int i = 0; i < nranks; i++) aa[i] = rank * 100 + i;
    NCCL(ncclAlltoAllConfig(aa, ab, 1, ncclInt32, comm, NULL, &init));
    for (int i = 0; i < nranks; i++)
      if (ab[i] != i * 100 + rank) FAIL("AlltoAllConfig [%d] = %d", i, ab[i]);
    for (int i = 0; i < nranks; i++) aa[i] = i;
    NCCL(ncclReduceScatterConfig(aa, &got, 1, ncclInt32, ncclSum, comm, NULL, &init));
    if (got != rank * nranks) FAIL("ReduceScatterConfig %d", got);
    NCCL(ncclGatherConfig(&v1, ag, 1, ncclInt32, 0, comm, NULL, &init));
    if (rank == 0)
      for (int i = 0; i < nranks; i++)
        if (ag[i] != i + 1) FAIL("GatherConfig [%d] = %d", i, ag[i]);
    /* an event needs CUDA (a made-up one is refused either way) */
    cc = init;
    cc.launchCompletionEvent = (cudaEvent_t)0x10;
    ncclResult_t er = ncclAllReduceConfig(&v1, &got, 1, ncclInt32, ncclSum, comm, NULL, &cc);
    const char* em = ncclGetLastError(NULL);
    if (!((er == ncclInvalidArgument && strstr(em, "needs CUDA")) ||
          (er == ncclUnhandledCudaError && strstr(em, "launchCompletionEvent"))))
      FAIL("AllReduceConfig with a made-up event -> %d (%s)", er, em);
    free(ag), free(aa), free(ab);
  }

  /* NCCL's profiling alias runs the same call (arguments forwarded as they are) */
  {
    int32_t v1 = rank + 1, got = 0;
    NCCL(pncclAllReduce(&v1, &got, 1, ncclInt32, ncclSum, comm, NULL));
    if (got != nranks * (nranks + 1) / 2) FAIL("pncclAllReduce %d", got);
  }

  /* parameters: commd's settings registry (COMMD_* names, and NCCL_* without the prefix) */
  {
    ncclParamHandle_t h = NULL;
    NCCL(ncclParamBind(&h, "COMMD_CLIENT_SPIN_US"));
    uint64_t spin = 0;
    NCCL(ncclParamGetU64(h, &spin));
    const char* s = NULL;
    NCCL(ncclParamGetStr(h, &s));
    if (strtoull(s, NULL, 10) != spin) FAIL("param: U64 %llu, string '%s'", (unsigned long long)spin, s);
    if (getenv("COMMD_CLIENT_SPIN_US") && spin != strtoull(getenv("COMMD_CLIENT_SPIN_US"), NULL, 10))
      FAIL("param: %llu, environment %s", (unsigned long long)spin, getenv("COMMD_CLIENT_SPIN_US"));
    char raw[64];
    int len = -1;
    NCCL(ncclParamGet(h, raw, sizeof raw, &len));
    if (len != (int)strlen(s) || memcmp(raw, s, len)) FAIL("ncclParamGet len %d", len);
    EXPECT_ERR(ncclInvalidArgument, ncclParamGet(h, raw, 0, &len), "maxLen is 0");
    const char* v = NULL;
    int vlen = -1;
    NCCL(ncclParamGetParameter("DEBUG", &v, &vlen));
    if (vlen != (int)strlen(v)) FAIL("ncclParamGetParameter(DEBUG) '%s' %d", v, vlen);
    EXPECT_ERR(ncclInvalidArgument, ncclParamBind(&h, "NCCL_IB_HCA"), "not read by commd");
    EXPECT_ERR(ncclInvalidArgument, ncclParamGetU64((ncclParamHandle_t)0x10, &spin), "not a parameter handle");
    const char** keys = NULL;
    int nkeys = 0;
    NCCL(ncclParamGetAllParameterKeys(&keys, &nkeys));
    int seen = 0;
    for (int i = 0; i < nkeys; i++) seen += !strcmp(keys[i], "COMMD_CLIENT_SPIN_US");
    if (nkeys < 10 || seen != 1) FAIL("parameter keys: %d, spin seen %d", nkeys, seen);
  }

  /* memory windows: collective registration (host memory: windows for collectives), in and
     out of groups, the user pointer, stale handles; one-sided ops need CUDA and device windows,
     and their reserved arguments are checked as NCCL checks them */
  {
    int32_t* wb = calloc(64, sizeof(int32_t));
    int32_t* wb2 = calloc(16, sizeof(int32_t));
    ncclWindow_t w = NULL, w2 = NULL, w3 = NULL;
    NCCL(ncclCommWindowRegister(comm, wb, 64 * sizeof(int32_t), &w, NCCL_WIN_COLL_SYMMETRIC));
    void* up = NULL;
    NCCL(ncclWinGetUserPtr(comm, w, &up));
    if (up != wb) FAIL("ncclWinGetUserPtr %p, want %p", up, (void*)wb);
    /* two windows in a group: registered at its end, usable after */
    NCCL(ncclGroupStart());
    NCCL(ncclCommWindowRegister(comm, wb2, 8 * sizeof(int32_t), &w2, NCCL_WIN_DEFAULT));
    NCCL(ncclCommWindowRegister(comm, wb2 + 8, 8 * sizeof(int32_t), &w3, NCCL_WIN_STRICT_ORDERING));
    if (w2 == NULL || w3 == NULL || w2 == w3) FAIL("window handles in a group %p %p", (void*)w2, (void*)w3);
    EXPECT_ERR(ncclInvalidUsage, ncclWinGetUserPtr(comm, w2, &up), "has not come yet");
    NCCL(ncclGroupEnd());
    NCCL(ncclWinGetUserPtr(comm, w3, &up));
    if (up != wb2 + 8) FAIL("ncclWinGetUserPtr in a group %p", up);
    /* collectives on window memory run as on any buffer */
    for (int i = 0; i < 64; i++) wb[i] = rank + i;
    NCCL(ncclAllReduce(wb, wb, 64, ncclInt32, ncclSum, comm, NULL));
    for (int i = 0; i < 64; i++)
      if (wb[i] != nranks * (nranks - 1) / 2 + nranks * i) FAIL("allreduce on a window [%d] %d", i, wb[i]);
    int32_t one = 1;
    EXPECT_ERR(ncclInvalidArgument, ncclSignal(0, 1, 0, 0, comm, NULL), "signal index 1");
    EXPECT_ERR(ncclInvalidArgument, ncclSignal(0, 0, 3, 0, comm, NULL), "context 3");
    EXPECT_ERR(ncclInvalidArgument, ncclSignal(0, 0, 0, 2, comm, NULL), "flags 2");
    EXPECT_ERR(ncclInvalidArgument, ncclSignal(nranks, 0, 0, 0, comm, NULL), "not a rank");
    EXPECT_ERR(ncclInvalidArgument, ncclPutSignal(&one, 1, ncclInt32, 0, NULL, 0, 0, 0, 0, comm, NULL),
               "the window is NULL");
    ncclWaitSignalDesc_t d = {0, 0, 0, 0};
    EXPECT_ERR(ncclInvalidArgument, ncclWaitSignal(1, &d, comm, NULL), "invalid opCnt 0");
    EXPECT_ERR(ncclInvalidArgument, ncclWaitSignal(0, &d, comm, NULL), "invalid arguments");
    d.opCnt = 1;
    d.sigIdx = 2;
    EXPECT_ERR(ncclInvalidArgument, ncclWaitSignal(1, &d, comm, NULL), "signal index 2");
    /* no CUDA here: a put says so (on a GPU machine, a host window is refused instead) */
    ncclResult_t pr = ncclPutSignal(&one, 1, ncclInt32, (rank + 1) % nranks, w, 0, 0, 0, 0, comm, NULL);
    const char* pm = ncclGetLastError(NULL);
    if (pr == ncclSuccess || !(strstr(pm, "CUDA") || strstr(pm, "host memory")))
      FAIL("put on a host window -> %d (%s)", pr, pm);
    EXPECT_ERR(ncclInvalidUsage, ncclCommWindowRegister(comm, wb, 64, &w2, NCCL_WIN_GIN_ONLY), "device API");
    EXPECT_ERR(ncclInvalidArgument, ncclCommWindowRegister(comm, wb, 64, &w2, 0x100), "unknown window flags");
    EXPECT_ERR(ncclInvalidArgument, ncclCommWindowRegister(comm, NULL, 64, &w2, 0), "needs a buffer");
    NCCL(ncclCommWindowDeregister(comm, w3));
    EXPECT_ERR(ncclInvalidArgument, ncclCommWindowDeregister(comm, w3), "not a live window");
    EXPECT_ERR(ncclInvalidArgument, ncclWinGetUserPtr(comm, (ncclWindow_t)0x10, &up), "not a live window");
    NCCL(ncclCommWindowDeregister(comm, w2));
    NCCL(ncclCommWindowDeregister(comm, w));
    free(wb), free(wb2);
  }

  /* the device API's host queries: the world team is every rank; the others are refused */
  {
    ncclTeam_t w = ncclTeamWorld(comm);
    if (w.nRanks != nranks || w.rank != rank || w.stride != 1)
      FAIL("ncclTeamWorld {%d, %d, %d}", w.nRanks, w.rank, w.stride);
    if (ncclTeamRankToWorld(comm, w, nranks - 1) != nranks - 1) FAIL("ncclTeamRankToWorld");
    if (ncclTeamRankToWorld(comm, w, nranks) != -1) FAIL("ncclTeamRankToWorld out of range");
    ncclTeam_t l = ncclTeamLsa(comm);
    if (l.nRanks != 0 || !strstr(ncclGetLastError(NULL), "ncclTeamLsa"))
      FAIL("ncclTeamLsa {%d}: %s", l.nRanks, ncclGetLastError(NULL));
    EXPECT_ERR(ncclInvalidUsage, ncclLsaBarrierCreateRequirement(l, 1, NULL, NULL), "device API");
  }

  /* the communicator still works after refused calls */
  NCCL(ncclAllReduce(&one, &sum, 1, ncclInt32, ncclSum, comm, NULL));
  if (sum != nranks * (nranks - 1) / 2) FAIL("allreduce after errors %d", sum);
  free(gr), free(rs), free(as), free(ar), free(all);
}

static void shrink(ncclComm_t comm) {
  int32_t one = 1, sum = 0;
  NCCL(ncclAllReduce(&one, &sum, 1, ncclInt32, ncclSum, comm, NULL));
  if (sum != nranks) FAIL("first allreduce %d", sum);
  int dead = nranks - 1;
  if (rank == dead) _exit(0);
  ncclResult_t r = ncclAllReduce(&one, &sum, 1, ncclInt32, ncclSum, comm, NULL);
  if (r != ncclRemoteError) FAIL("allreduce with a dead peer -> %d (%s)", r, ncclGetLastError(NULL));
  /* error paths: nothing is made, newcomm is NCCL_COMM_NULL */
  ncclComm_t child = (ncclComm_t)&one;
  int self = rank, past = nranks, twice[2] = {dead, dead};
  EXPECT_ERR(ncclInvalidArgument, ncclCommShrink(comm, &self, 1, &child, NULL, 0), "own excludeRanksList");
  if (child != NULL) FAIL("a refused shrink left newcomm %p", (void*)child);
  EXPECT_ERR(ncclInvalidArgument, ncclCommShrink(comm, &past, 1, &child, NULL, 0), "ranks");
  EXPECT_ERR(ncclInvalidArgument, ncclCommShrink(comm, twice, 2, &child, NULL, 0), "twice");
  EXPECT_ERR(ncclInvalidArgument, ncclCommShrink(comm, &dead, 1, &child, NULL, 7), "shrinkFlags 7");
  EXPECT_ERR(ncclInvalidArgument, ncclCommShrink(comm, NULL, 1, &child, NULL, 0), "null");
  EXPECT_ERR(ncclInvalidArgument, ncclCommRevoke(comm, 1), "revokeFlags 1");
  NCCL(ncclCommShrink(comm, &dead, 1, &child, NULL, rank == 0 ? NCCL_SHRINK_ABORT : NCCL_SHRINK_DEFAULT));
  int cr = -1, cn = -1;
  NCCL(ncclCommUserRank(child, &cr));
  NCCL(ncclCommCount(child, &cn));
  if (cr != rank || cn != nranks - 1) FAIL("child rank %d of %d", cr, cn);
  int32_t mine = rank + 1, total = 0;
  NCCL(ncclAllReduce(&mine, &total, 1, ncclInt32, ncclSum, child, NULL));
  if (total != (nranks - 1) * nranks / 2) FAIL("child allreduce %d", total);
  /* revoke: every rank's next op fails naming the revoker; the revoked child is shrunk again */
  NCCL(ncclAllReduce(&mine, &total, 1, ncclInt32, ncclSum, child, NULL));
  if (rank == 0) NCCL(ncclCommRevoke(child, NCCL_REVOKE_DEFAULT));
  for (int i = 0; i < 500; i++) {
    r = ncclAllReduce(&mine, &total, 1, ncclInt32, ncclSum, child, NULL);
    if (r != ncclSuccess) break;
  }
  if (r != ncclRemoteError || !strstr(ncclGetLastError(NULL), "revoked"))
    FAIL("op after revoke -> %d (%s)", r, ncclGetLastError(NULL));
  ncclComm_t again = NULL;
  NCCL(ncclCommShrink(child, NULL, 0, &again, NULL, NCCL_SHRINK_DEFAULT));
  NCCL(ncclAllReduce(&mine, &total, 1, ncclInt32, ncclSum, again, NULL));
  if (total != (nranks - 1) * nranks / 2) FAIL("allreduce after revoke and shrink %d", total);
  NCCL(ncclCommDestroy(again));
  NCCL(ncclCommDestroy(child));
  NCCL(ncclCommAbort(comm));
}

int main(int argc, char** argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s RANK NRANKS DIR ops|kill\n", argv[0]);
    return 2;
  }
  rank = atoi(argv[1]);
  nranks = atoi(argv[2]);
  const char* dir = argv[3];
  ncclComm_t comm = init(dir, "id");
  if (!strcmp(argv[4], "ops")) {
    ops(comm, dir);
    NCCL(ncclCommFinalize(comm));
    NCCL(ncclCommDestroy(comm));
    int n;
    EXPECT_ERR(ncclInvalidArgument, ncclCommCount(comm, &n), "not a live communicator");
  } else if (!strcmp(argv[4], "kill")) {
    int32_t one = 1, sum = 0;
    NCCL(ncclAllReduce(&one, &sum, 1, ncclInt32, ncclSum, comm, NULL));
    if (sum != nranks) FAIL("first allreduce %d", sum);
    if (rank == nranks - 1) _exit(0);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    ncclResult_t r = ncclAllReduce(&one, &sum, 1, ncclInt32, ncclSum, comm, NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (r != ncclRemoteError) FAIL("allreduce with a dead peer -> %d (%s)", r, ncclGetLastError(NULL));
    printf("rank %d: op failed after %.2f s: %s\n", rank,
           (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9, ncclGetLastError(NULL));
    ncclResult_t ae = ncclSuccess;
    NCCL(ncclCommGetAsyncError(comm, &ae));
    if (ae != ncclRemoteError) FAIL("async error %d, want ncclRemoteError", ae);
    NCCL(ncclCommAbort(comm));
  } else if (!strcmp(argv[4], "shrink")) {
    shrink(comm);
  } else {
    FAIL("unknown mode %s", argv[4]);
  }
  printf("OK\n");
  return 0;
}
