/* Issue 24 probe: how fast can a daemon read and write other processes' private pages, and
 * what would a zero-copy host all-reduce cost on this machine?
 *
 * RANKS child processes each hold SIZE bytes of ordinary (malloc'd) float32 memory and tell the
 * parent (the "daemon") its address. The parent then times, median of REPS:
 *   memcpy        one local SIZE copy (what a staging copy costs; staging does 2 per rank per op)
 *   readv-whole   process_vm_readv of each rank's SIZE in one call
 *   readv-blocks  the same in BLOCK pieces into one cache-sized local buffer
 *   procmem       pread(2) of /proc/<pid>/mem in BLOCK pieces (an fd bound to the process: no pid
 *                 reuse hazard, but the kernel copies through a bounce page)
 *   writev-blocks process_vm_writev of a local block into each rank, BLOCK pieces
 *   allreduce-T   a whole sum all-reduce the zero-copy way with T threads: per block, read every
 *                 rank's piece (process_vm_readv), sum them in rank order in cache, write the sum
 *                 back into every rank (process_vm_writev); the result is checked
 *
 *   cc -O2 -pthread -o /tmp/host_vm_copy scripts/probes/host_vm_copy.c
 *   /tmp/host_vm_copy [SIZE_MIB=32] [RANKS=4] [BLOCK_KIB=256] [REPS=7]
 *
 * Needs ptrace access to the children (same user; Yama ptrace_scope 0 or 1 allows a parent).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAXR 16

static size_t SIZE, BLOCK;
static int RANKS, REPS;
static pid_t pids[MAXR];
static uintptr_t addrs[MAXR];
static int memfds[MAXR];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void die(const char *what) {
    perror(what);
    for (int r = 0; r < RANKS; r++)
        if (pids[r] > 0) kill(pids[r], SIGKILL);
    exit(1);
}

static void vm(int write, int r, void *local, uintptr_t remote, size_t n) {
    struct iovec l = {local, n}, rm = {(void *)remote, n};
    ssize_t got = write ? process_vm_writev(pids[r], &l, 1, &rm, 1, 0)
                        : process_vm_readv(pids[r], &l, 1, &rm, 1, 0);
    if (got != (ssize_t)n) die(write ? "process_vm_writev" : "process_vm_readv");
}

/* Value of element i of rank r's input (exact in f32 for the sizes used). */
static float input(int r, size_t i) { return (float)((r + 1) * 1000 + (int)(i % 997)); }

struct job {
    size_t lo, hi;
};

static void *allreduce_part(void *arg) {
    struct job *j = arg;
    float *acc = aligned_alloc(64, BLOCK), *tmp = aligned_alloc(64, BLOCK);
    for (size_t off = j->lo; off < j->hi; off += BLOCK) {
        size_t n = j->hi - off < BLOCK ? j->hi - off : BLOCK;
        vm(0, 0, acc, addrs[0] + off, n);
        for (int r = 1; r < RANKS; r++) {
            vm(0, r, tmp, addrs[r] + off, n);
            for (size_t k = 0; k < n / 4; k++) acc[k] += tmp[k];
        }
        for (int r = 0; r < RANKS; r++) vm(1, r, acc, addrs[r] + off, n);
    }
    free(acc);
    free(tmp);
    return NULL;
}

static double allreduce(int threads) {
    pthread_t t[8];
    struct job jobs[8];
    size_t per = (SIZE / threads + BLOCK - 1) / BLOCK * BLOCK;
    double t0 = now();
    for (int k = 0; k < threads; k++) {
        jobs[k].lo = per * k < SIZE ? per * k : SIZE;
        jobs[k].hi = per * (k + 1) < SIZE ? per * (k + 1) : SIZE;
        pthread_create(&t[k], NULL, allreduce_part, &jobs[k]);
    }
    for (int k = 0; k < threads; k++) pthread_join(t[k], NULL);
    return now() - t0;
}

/* Writes every rank's input back (each rank's pages hold the all-reduce result after a run). */
static void reset_inputs(float *scratch) {
    for (size_t i = 0; i < SIZE / 4; i++) scratch[i] = 0;
    for (int r = 0; r < RANKS; r++) {
        for (size_t i = 0; i < SIZE / 4; i++) scratch[i] = input(r, i);
        vm(1, r, scratch, addrs[r], SIZE);
    }
}

static void report(const char *name, double *t, double bytes) {
    qsort(t, REPS, sizeof *t, cmp);
    double m = t[REPS / 2];
    printf("%-16s %9.2f ms %8.2f GB/s  (min %.2f ms)\n", name, m * 1e3, bytes / m / 1e9, t[0] * 1e3);
}

int main(int argc, char **argv) {
    SIZE = (size_t)(argc > 1 ? atoi(argv[1]) : 32) << 20;
    RANKS = argc > 2 ? atoi(argv[2]) : 4;
    BLOCK = (size_t)(argc > 3 ? atoi(argv[3]) : 256) << 10;
    REPS = argc > 4 ? atoi(argv[4]) : 7;
    if (RANKS < 1 || RANKS > MAXR || REPS < 1 || REPS > 99 || BLOCK == 0 || SIZE % BLOCK) {
        fprintf(stderr, "usage: %s [SIZE_MIB] [RANKS<=16] [BLOCK_KIB dividing SIZE] [REPS<100]\n", argv[0]);
        return 2;
    }
    for (int r = 0; r < RANKS; r++) {
        int up[2], down[2];
        if (pipe(up) || pipe(down)) die("pipe");
        pid_t p = fork();
        if (p < 0) die("fork");
        if (p == 0) {
            float *buf = aligned_alloc(4096, SIZE);
            for (size_t i = 0; i < SIZE / 4; i++) buf[i] = input(r, i);
            uintptr_t a = (uintptr_t)buf;
            if (write(up[1], &a, sizeof a) != sizeof a) _exit(1);
            char c;
            (void)!read(down[0], &c, 1); /* until the parent closes its end */
            _exit(0);
        }
        pids[r] = p;
        close(up[1]);
        close(down[0]);
        if (read(up[0], &addrs[r], sizeof addrs[r]) != sizeof addrs[r]) die("read child address");
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/mem", p);
        memfds[r] = open(path, O_RDWR);
        if (memfds[r] < 0) die(path);
    }
    float *a = aligned_alloc(64, SIZE), *b = aligned_alloc(64, SIZE), *blk = aligned_alloc(64, BLOCK);
    memset(a, 1, SIZE);
    memset(b, 2, SIZE);
    double t[100], all = (double)SIZE * RANKS;
    printf("size %zu MiB, %d ranks, block %zu KiB, median of %d\n", SIZE >> 20, RANKS, BLOCK >> 10, REPS);
    for (int k = 0; k < REPS; k++) {
        double t0 = now();
        memcpy(b, a, SIZE);
        t[k] = now() - t0;
    }
    report("memcpy (1 rank)", t, SIZE);
    for (int k = 0; k < REPS; k++) {
        double t0 = now();
        for (int r = 0; r < RANKS; r++) vm(0, r, b, addrs[r], SIZE);
        t[k] = now() - t0;
    }
    report("readv-whole", t, all);
    for (int k = 0; k < REPS; k++) {
        double t0 = now();
        for (int r = 0; r < RANKS; r++)
            for (size_t off = 0; off < SIZE; off += BLOCK) vm(0, r, blk, addrs[r] + off, BLOCK);
        t[k] = now() - t0;
    }
    report("readv-blocks", t, all);
    for (int k = 0; k < REPS; k++) {
        double t0 = now();
        for (int r = 0; r < RANKS; r++)
            for (size_t off = 0; off < SIZE; off += BLOCK)
                if (pread(memfds[r], blk, BLOCK, (off_t)(addrs[r] + off)) != (ssize_t)BLOCK) die("pread /proc/pid/mem");
        t[k] = now() - t0;
    }
    report("procmem-blocks", t, all);
    for (int k = 0; k < REPS; k++) {
        double t0 = now();
        for (int r = 0; r < RANKS; r++)
            for (size_t off = 0; off < SIZE; off += BLOCK) vm(1, r, blk, addrs[r] + off, BLOCK);
        t[k] = now() - t0;
    }
    report("writev-blocks", t, all);
    for (int threads = 1; threads <= 2; threads++) {
        for (int k = 0; k < REPS; k++) {
            reset_inputs(b);
            t[k] = allreduce(threads);
        }
        /* Check: every rank now holds the sum over ranks. */
        for (int r = 0; r < RANKS; r++) {
            vm(0, r, b, addrs[r], SIZE);
            for (size_t i = 0; i < SIZE / 4; i += 4099) {
                float want = 0;
                for (int q = 0; q < RANKS; q++) want += input(q, i);
                if (b[i] != want) {
                    fprintf(stderr, "rank %d element %zu: %g, want %g\n", r, i, b[i], want);
                    die("check");
                }
            }
        }
        char name[32];
        snprintf(name, sizeof name, "allreduce-%dthr", threads);
        report(name, t, all); /* GB/s here: every rank's SIZE once in and once out */
    }
    for (int r = 0; r < RANKS; r++) kill(pids[r], SIGKILL);
    while (wait(NULL) > 0) {}
    return 0;
}
