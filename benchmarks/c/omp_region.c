/* omp_region.c -- what one OpenMP parallel region costs on this machine
 * under the wait policy of the environment (OMP_WAIT_POLICY), with no work
 * in it: the floor under any call the kernels run on more than one thread.
 *
 * Each round enters `#pragma omp parallel num_threads(T)` with an empty
 * body, after the calling thread has (a) just left the previous region,
 * (b) computed alone for 200 us, as between two model layers' attention
 * calls, or (c) slept for 1 ms.  It prints, per case, the median over the
 * rounds of: the whole region, the delay before the calling thread runs the
 * body (the region's start: waking the workers), the delay before the last
 * worker runs it, and the rest (the closing barrier).  Under the passive
 * policy libgomp's workers sleep between regions, so the start and the
 * barrier each wait on a wake-up; under the active one they spin.
 *
 *   cc -O2 -std=c11 -D_DEFAULT_SOURCE -fopenmp benchmarks/c/omp_region.c -o omp_region
 *   OMP_WAIT_POLICY=passive ./omp_region [threads] [rounds]
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

int main(int argc, char **argv) {
    const int nthreads = argc > 1 ? atoi(argv[1]) : 2, rounds = argc > 2 ? atoi(argv[2]) : 200;
    if (nthreads < 2 || nthreads > 256 || rounds < 1) {
        fprintf(stderr, "usage: omp_region [threads >= 2] [rounds]\n");
        return 2;
    }
    const char *pol = getenv("OMP_WAIT_POLICY");
    printf("%d threads, OMP_WAIT_POLICY=%s, %d rounds, medians in us\n", nthreads,
           pol ? pol : "(unset)", rounds);
    double *tot = malloc(sizeof(double) * rounds), *t0s = malloc(sizeof(double) * rounds);
    double *tws = malloc(sizeof(double) * rounds), *bar = malloc(sizeof(double) * rounds);
    double *start = malloc(sizeof(double) * nthreads);
    if (!tot || !t0s || !tws || !bar || !start) return 1;
    static const char *const cases[3] = {"back to back", "after 200 us of work", "after 1 ms asleep"};
    volatile double sink = 0;
#pragma omp parallel num_threads(nthreads) /* the workers exist before the first round */
    start[omp_get_thread_num()] = now();
    for (int c = 0; c < 3; c++) {
        for (int r = 0; r < rounds; r++) {
            if (c == 1) {
                const double w = now();
                while (now() - w < 200e-6) sink += 1;
            } else if (c == 2) {
                usleep(1000);
            }
            int team = 1; /* the threads the runtime gave (OMP_DYNAMIC may give fewer) */
            const double t0 = now();
#pragma omp parallel num_threads(nthreads)
            {
                start[omp_get_thread_num()] = now();
                if (omp_get_thread_num() == 0) team = omp_get_num_threads();
            }
            const double t1 = now();
            if (team < nthreads && c == 0 && r == 0)
                printf("  (the runtime gave only %d of the %d threads asked for)\n", team, nthreads);
            double last = start[0];
            for (int i = 1; i < team; i++)
                if (start[i] > last) last = start[i];
            tot[r] = t1 - t0;
            t0s[r] = start[0] - t0;
            tws[r] = last - t0;
            bar[r] = t1 - last;
        }
        printf("  %-22s region %7.1f   caller starts %7.1f   last worker starts %7.1f   "
               "after it %7.1f\n",
               cases[c], 1e6 * median(tot, rounds), 1e6 * median(t0s, rounds),
               1e6 * median(tws, rounds), 1e6 * median(bar, rounds));
    }
    return sink == 0.5 ? 3 : 0;
}
