// Host against GPU time of a send/recv group in a ring (ncclGroupStart; ncclSend; ncclRecv;
// ncclGroupEnd), against any NCCL-API library, and the raw cost of kernel launches on the host.
// Built and run by tests/gpu/nccl_sr_probe.sh.
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <mpi.h>
#include <cuda_runtime.h>
#include <nccl.h>
#define CK(x) do { auto e = (x); if (e != 0) { fprintf(stderr, "%s:%d %s -> %d\n", __FILE__, __LINE__, #x, (int)e); exit(1); } } while (0)
struct Big { char b[1484]; };
struct Small { char b[152]; };
__global__ void kbig(Big a) { if (a.b[threadIdx.x] == 123 && threadIdx.x == 9999) printf("x"); }
__global__ void ksmall(Small a) { if (a.b[threadIdx.x % 152] == 123 && threadIdx.x == 9999) printf("x"); }
static double now() { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, n; MPI_Comm_rank(MPI_COMM_WORLD, &rank); MPI_Comm_size(MPI_COMM_WORLD, &n);
  int ndev; CK(cudaGetDeviceCount(&ndev)); CK(cudaSetDevice(rank % ndev));
  size_t bytes = argc > 1 ? atol(argv[1]) : 8;
  int iters = argc > 2 ? atoi(argv[2]) : 2000;
  ncclUniqueId id; if (rank == 0) CK(ncclGetUniqueId(&id));
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t comm; CK(ncclCommInitRank(&comm, n, id, rank));
  void *s, *r; CK(cudaMalloc(&s, bytes)); CK(cudaMalloc(&r, bytes));
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  int nxt = (rank + 1) % n, prv = (rank + n - 1) % n;
  auto one = [&]() { CK(ncclGroupStart()); CK(ncclSend(s, bytes, ncclUint8, nxt, comm, st)); CK(ncclRecv(r, bytes, ncclUint8, prv, comm, st)); CK(ncclGroupEnd()); };
  for (int i = 0; i < 200; i++) one();
  CK(cudaStreamSynchronize(st)); MPI_Barrier(MPI_COMM_WORLD);
  for (int rep = 0; rep < 3; rep++) {
    double t0 = now();
    for (int i = 0; i < iters; i++) one();
    double t1 = now();
    CK(cudaStreamSynchronize(st));
    double t2 = now();
    MPI_Barrier(MPI_COMM_WORLD);
    // one at a time: the round trip of one group
    double t3 = now();
    for (int i = 0; i < 200; i++) { one(); CK(cudaStreamSynchronize(st)); }
    double t4 = now();
    MPI_Barrier(MPI_COMM_WORLD);
    printf("rank %d bytes %zu: host %.2f us/group, total %.2f us/group, synced %.2f us/group\n", rank, bytes, (t1 - t0) / iters, (t2 - t0) / iters, (t4 - t3) / 200);
  }
  // raw launches on this stream (each rank its own GPU or a shared one)
  Big b{}; Small sm{};
  for (int rep = 0; rep < 2; rep++) {
    double t0 = now();
    for (int i = 0; i < iters; i++) kbig<<<2, 256, 0, st>>>(b);
    double t1 = now(); CK(cudaStreamSynchronize(st)); double t2 = now();
    for (int i = 0; i < iters; i++) ksmall<<<2, 256, 0, st>>>(sm);
    double t3 = now(); CK(cudaStreamSynchronize(st)); double t4 = now();
    cudaEvent_t ev; CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    double t5 = now();
    for (int i = 0; i < iters; i++) { ksmall<<<2, 256, 0, st>>>(sm); CK(cudaEventRecord(ev, st)); }
    double t6 = now(); CK(cudaStreamSynchronize(st)); double t7 = now();
    printf("rank %d launch 1484 B: host %.2f total %.2f; 152 B: host %.2f total %.2f; 152 B + event: host %.2f total %.2f us\n", rank,
           (t1 - t0) / iters, (t2 - t0) / iters, (t3 - t2) / iters, (t4 - t2) / iters, (t6 - t5) / iters, (t7 - t5) / iters);
  }
  ncclCommDestroy(comm);
  MPI_Finalize();
  return 0;
}
