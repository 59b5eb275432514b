/* Syscall storm for the collector throughput benchmark: N getppid calls as
 * fast as one core can make them.  Usage: storm N */
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++)
        syscall(SYS_getppid);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%ld %.6f\n", n, (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9);
    return 0;
}
