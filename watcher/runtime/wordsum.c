/* Wrapping sums of 32-bit words, the checksum of watcher/runtime/checksum.py,
 * in one pass over memory.  torch needs two passes where a copy or a
 * concatenation comes first (clone then sum; cat then sum); here the words
 * are summed while they are read.  Compiled by `watcher run` on the node
 * (wordsum.py); without a compiler the torch path gives the same sums. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

uint32_t ws_sum(const uint32_t *p, size_t n)
{
    uint32_t acc = 0;
    for (size_t i = 0; i < n; i++)
        acc += p[i];
    return acc;
}

/* Copies n bytes from src to dst with stores that bypass the cache (x86-64:
 * SSE2 streaming stores; elsewhere memcpy).  For state copies: they rotate
 * through buffers the cache no longer holds and are read again only after a
 * failure, so plain stores would first read every destination line from
 * memory and evict the training step's own data (3.3 MB: 410 -> 240 us).
 * The caller fences once after its last copy. */
static void copy_nt(uint8_t *restrict dst, const uint8_t *restrict src, size_t n)
{
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
#else
    memcpy(dst, src, n);
#endif
}

/* Copies n words from src to dst and returns their sum.  Plain stores: the
 * destination (a retry copy's spare, reused every step) stays in cache. */
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

/* One block of the loop below with the word sums too: 16 float lanes of
 * squares and 16 word lanes, from one read of x[i .. i + 16 * blocks).
 * Each float lane gets exactly the additions the plain loop gives it (SSE
 * adds and multiplies lane by lane, as the scalar code does), so the sum of
 * squares has the same bits either way. */
static size_t block_sumsq_words(const float *x, size_t i, size_t blocks, float lane[16], uint32_t wl[16])
{
#if defined(__SSE2__)
    __m128 f0 = _mm_loadu_ps(lane), f1 = _mm_loadu_ps(lane + 4);
    __m128 f2 = _mm_loadu_ps(lane + 8), f3 = _mm_loadu_ps(lane + 12);
    __m128i w0 = _mm_loadu_si128((const __m128i *)wl), w1 = _mm_loadu_si128((const __m128i *)(wl + 4));
    __m128i w2 = _mm_loadu_si128((const __m128i *)(wl + 8)), w3 = _mm_loadu_si128((const __m128i *)(wl + 12));
    for (size_t b = 0; b < blocks; b++, i += 16) {
        __m128i u0 = _mm_loadu_si128((const __m128i *)(x + i)), u1 = _mm_loadu_si128((const __m128i *)(x + i + 4));
        __m128i u2 = _mm_loadu_si128((const __m128i *)(x + i + 8)), u3 = _mm_loadu_si128((const __m128i *)(x + i + 12));
        __m128 v0 = _mm_castsi128_ps(u0), v1 = _mm_castsi128_ps(u1);
        __m128 v2 = _mm_castsi128_ps(u2), v3 = _mm_castsi128_ps(u3);
        f0 = _mm_add_ps(f0, _mm_mul_ps(v0, v0));
        f1 = _mm_add_ps(f1, _mm_mul_ps(v1, v1));
        f2 = _mm_add_ps(f2, _mm_mul_ps(v2, v2));
        f3 = _mm_add_ps(f3, _mm_mul_ps(v3, v3));
        w0 = _mm_add_epi32(w0, u0);
        w1 = _mm_add_epi32(w1, u1);
        w2 = _mm_add_epi32(w2, u2);
        w3 = _mm_add_epi32(w3, u3);
    }
    _mm_storeu_ps(lane, f0), _mm_storeu_ps(lane + 4, f1), _mm_storeu_ps(lane + 8, f2), _mm_storeu_ps(lane + 12, f3);
    _mm_storeu_si128((__m128i *)wl, w0), _mm_storeu_si128((__m128i *)(wl + 4), w1);
    _mm_storeu_si128((__m128i *)(wl + 8), w2), _mm_storeu_si128((__m128i *)(wl + 12), w3);
#else
    const uint32_t *u = (const uint32_t *)x;  /* two views of the same memory, both only read */
    for (size_t b = 0; b < blocks; b++, i += 16)
        for (int l = 0; l < 16; l++) {
            lane[l] += x[i + l] * x[i + l];
            wl[l] += u[i + l];
        }
#endif
    return i;
}

/* The sum of squares of n floats in blocks of 1024 values (see below);
 * with `words`, the word sum of the same values is added to *words in the
 * same loop, so both come from one read of memory. */
static double sumsq_f32(const float *x, size_t n, uint32_t *words)
{
    double total = 0;
    uint32_t wl[16] = {0};
    size_t i = 0;
    while (i + 16 <= n) {
        size_t blocks = (n - i) / 16;
        if (blocks > 64)
            blocks = 64;
        float lane[16] = {0};
        if (words) {
            i = block_sumsq_words(x, i, blocks, lane, wl);
        } else {
            for (size_t b = 0; b < blocks; b++, i += 16)
                for (int l = 0; l < 16; l++)
                    lane[l] += x[i + l] * x[i + l];
        }
        double s = 0;
        for (int l = 0; l < 16; l++)
            s += lane[l];
        total += s;
    }
    if (words) {
        for (int l = 0; l < 16; l++)
            *words += wl[l];
        *words += ws_sum((const uint32_t *)(x + i), n - i);
    }
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
        copy_nt(dst, (const uint8_t *)(uintptr_t)ptrs[j], nbytes[j]);
        dst += nbytes[j];
    }
#if defined(__SSE2__)
    _mm_sfence();  /* the streamed lines are in memory before the slot says the copy is whole */
#endif
}
