/* Wrapping sums of 32-bit words, the checksum of watcher/runtime/checksum.py,
 * in one pass over memory.  torch needs two passes where a copy or a
 * concatenation comes first (clone then sum; cat then sum); here the words
 * are summed while they are read.  Compiled by `watcher run` on the node
 * (wordsum.py); without a compiler the torch path gives the same sums. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

uint32_t ws_sum(const uint32_t *p, size_t n)
{
    uint32_t acc = 0;
    for (size_t i = 0; i < n; i++)
        acc += p[i];
    return acc;
}

/* Copies n words from src to dst and returns their sum. */
uint32_t ws_copy_sum(uint32_t *restrict dst, const uint32_t *restrict src, size_t n)
{
    uint32_t acc = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t w = src[i];
        dst[i] = w;
        acc += w;
    }
    return acc;
}

/* The sum over k buffers: ptrs[i] holds counts[i] words. */
uint32_t ws_sum_many(const uint64_t *ptrs, const uint64_t *counts, size_t k)
{
    uint32_t acc = 0;
    for (size_t j = 0; j < k; j++)
        acc += ws_sum((const uint32_t *)(uintptr_t)ptrs[j], counts[j]);
    return acc;
}

/* The sum of squares of n floats in blocks of 1024 values (see below);
 * with `words`, the word sum of each block is added to *words while the
 * block is in L1, so both come from one read of memory. */
static double sumsq_f32(const float *x, size_t n, uint32_t *words)
{
    double total = 0;
    size_t i = 0;
    while (i + 16 <= n) {
        size_t blocks = (n - i) / 16, from = i;
        if (blocks > 64)
            blocks = 64;
        float lane[16] = {0};
        for (size_t b = 0; b < blocks; b++, i += 16)
            for (int l = 0; l < 16; l++)
                lane[l] += x[i + l] * x[i + l];
        double s = 0;
        for (int l = 0; l < 16; l++)
            s += lane[l];
        total += s;
        if (words)
            *words += ws_sum((const uint32_t *)(x + from), i - from);
    }
    if (words)
        *words += ws_sum((const uint32_t *)(x + i), n - i);
    for (; i < n; i++)
        total += (double)x[i] * x[i];
    return total;
}

/* The sum of squares of k float32 buffers (ptrs[i] holds counts[i] floats):
 * the gradient norm in one call, where torch's per-tensor norms, stack and
 * norm cost ~90 us of dispatch for the reference model's 29 tensors.  Sixteen
 * float lanes over blocks of 1024 values (vectorised: ~20 us for 1.1 MB),
 * each block's lanes added into a double, so float error stays within a
 * block.  A fixed order: the same bits every time (a replay compares the
 * norm with the record). */
double ws_sumsq_f32_many(const uint64_t *ptrs, const uint64_t *counts, size_t k)
{
    double total = 0;
    for (size_t j = 0; j < k; j++)
        total += sumsq_f32((const float *)(uintptr_t)ptrs[j], counts[j], NULL);
    return total;
}

/* The word sum of n float32 values, and their sum of squares into *sumsq
 * (the same bits as ws_sumsq_f32_many over this one buffer), from one read
 * of memory: a reduced gradient's checksum and its part of the gradient
 * norm together. */
uint32_t ws_sum_sumsq_f32(const float *p, size_t n, double *sumsq)
{
    uint32_t acc = 0;
    *sumsq = sumsq_f32(p, n, &acc);
    return acc;
}

/* Copies k buffers (ptrs[i], nbytes[i] bytes) into dst back to back: a
 * state copy (replay/state_copy.py) in one call instead of one torch copy
 * per tensor, whose fixed cost was half the copy's time. */
void ws_gather(uint8_t *restrict dst, const uint64_t *ptrs, const uint64_t *nbytes, size_t k)
{
    for (size_t j = 0; j < k; j++) {
        memcpy(dst, (const void *)(uintptr_t)ptrs[j], nbytes[j]);
        dst += nbytes[j];
    }
}
