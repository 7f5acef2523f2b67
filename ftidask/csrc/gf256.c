/* gf256.c: GF(2^8) "matrix times stripes" for the Reed-Solomon codec of level 3.
 *
 * out[i] (= or ^=) XOR_j c[i][j] * in[j], byte by byte, in the field of ftidask/levels/erasure.py
 * (polynomial x^8 + x^4 + x^3 + x^2 + 1, 0x11D). One routine serves encoding (C times the data),
 * decoding (rows of an inverse matrix times the survivors) and parity updates (parity ^= c * delta),
 * so the bytes are those of the NumPy codec by construction: only the way to compute them differs.
 *
 * Why split nibbles: multiplying by a constant c is linear over GF(2), so c*x = c*(x & 0x0f) XOR
 * c*(x & 0xf0). Each half takes one of 16 values: two 16-byte tables per coefficient, looked up
 * 16/32/64 bytes at a time by PSHUFB/VPSHUFB (TBL on aarch64), which index a 16-byte table by the
 * low 4 bits of each byte. With GFNI, one GF2P8AFFINEQB applies the 8x8 bit matrix of "times c"
 * to every byte instead. GF2P8MULB is not used: it multiplies modulo 0x11B (AES), not our 0x11D.
 *
 * Coefficient 1 (all of row 0 and column 0 of the codec's parity matrix: 7 of 16 for k = m = 4)
 * is a plain XOR: the nibble kernels test a per-coefficient flag, a predictable branch, instead of
 * two lookups.
 *
 * Why prefetch: the nibble kernels spend enough instructions per byte that the out-of-order core
 * runs out of room before the hardware prefetcher gets the next lines of k input streams; asking
 * 2 KiB ahead doubles their speed on stripes larger than the caches (GFNI kernels do it too).
 *
 * Why rows in registers: the kernel walks the stripes once, vector by vector. For each position it
 * loads each input once and updates up to G outputs held in registers (G = 4 with 16 vector
 * registers, 8 with 32), so memory traffic is k loads and G stores per vector whatever k and G
 * are. More than G outputs take several passes, chunked so that the inputs are re-read from cache.
 *
 * Why run-time dispatch: the extension is built with no -m flags so one binary runs on any
 * x86-64; each kernel is compiled for its ISA by a function attribute and picked once from the
 * CPU's features. Lengths that are not a multiple of the vector width end with scalar code;
 * loads and stores are unaligned, so any buffer offset works.
 *
 * Why non-temporal stores: for stripes far larger than the caches the kernel is bound by memory
 * bandwidth, and a plain store first reads each output line it overwrites (read for ownership).
 * Streaming stores skip that read: a k = m = 4 encode then moves 8 bytes per data byte instead
 * of 12, as many as a memory copy. Used on x86 when nothing is accumulated, the call is large
 * and all outputs share one alignment (a scalar head aligns them).
 */
#include "gf256.h"

#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define GF_X86 1
#include <cpuid.h>
#include <immintrin.h>
#elif defined(__aarch64__)
#define GF_NEON 1
#include <arm_neon.h>
#endif

#define GF_POLY 0x11D
static uint8_t gf_mul_tab[256][256];

typedef void (*gf_pass_fn)(const uint8_t *tabs, int g, int k, const uint8_t *const *in, uint8_t *const *out,
                           size_t lo, size_t hi, int accumulate, int nt, const uint8_t *ones);

/* Non-temporal stores from this much traffic (inputs + outputs) on: well past the L2 and a core's
 * share of the L3, so the outputs would leave the caches before anyone reads them anyway. */
#define GF_STREAM_MIN ((size_t)8 << 20)

struct gf_isa {
    const char *name;
    gf_pass_fn pass; /* NULL: the scalar code */
    size_t width;    /* bytes per vector */
    int gmax;        /* outputs held in registers per pass */
    int affine;      /* tables are GFNI bit matrices (8 bytes per coefficient), else nibble tables */
    int stream;      /* the pass honours nt (aligned non-temporal stores) */
    int (*cpu_has)(void);
};

void
gf_init(void)
{
    uint8_t exp[510];
    int log[256] = {0};
    unsigned x = 1;
    if (gf_mul_tab[2][2]) /* built already (2 * 2 = 4): a second import changes nothing */
        return;
    for (int i = 0; i < 255; i++) {
        exp[i] = (uint8_t)x;
        log[x] = i;
        x = (x << 1) ^ ((x & 0x80) ? GF_POLY : 0);
    }
    for (int i = 255; i < 510; i++)
        exp[i] = exp[i - 255];
    for (int a = 0; a < 256; a++)
        for (int b = 0; b < 256; b++)
            gf_mul_tab[a][b] = (a && b) ? exp[log[a] + log[b]] : 0;
}

/* Rows computed byte by byte: the tails past the last whole vector, and the whole job on CPUs
 * with no vector kernel (in blocks, so that each output stays in L1 while the inputs stream). */
static void
scalar_range(const uint8_t *mat, int m, int k, const uint8_t *const *in, uint8_t *const *out, size_t lo,
             size_t hi, int accumulate)
{
    for (size_t b0 = lo; b0 < hi; b0 += 4096) {
        size_t b1 = hi - b0 < 4096 ? hi : b0 + 4096;
        for (int i = 0; i < m; i++) {
            uint8_t *o = out[i];
            if (!accumulate)
                memset(o + b0, 0, b1 - b0);
            for (int j = 0; j < k; j++) {
                const uint8_t *t = gf_mul_tab[mat[(size_t)i * k + j]], *s = in[j];
                for (size_t x = b0; x < b1; x++)
                    o[x] ^= t[s[x]];
            }
        }
    }
}

/* The bit matrix of "times c" for GF2P8AFFINEQB: output bit i is the parity of (byte 7 - i of
 * the matrix) AND x, so that byte has bit j set when c * 2^j has bit i set. */
static uint64_t
affine_matrix(uint8_t c)
{
    uint64_t a = 0;
    for (int i = 0; i < 8; i++) {
        unsigned row = 0;
        for (int j = 0; j < 8; j++)
            row |= ((gf_mul_tab[c][1u << j] >> i) & 1u) << j;
        a |= (uint64_t)row << (8 * (7 - i));
    }
    return a;
}

/* One pass over [lo, hi) (a multiple of W) for G outputs. Tables: for input j, output p, the
 * low-nibble then the high-nibble table, each repeated to W bytes (PSHUFB looks up per 16-byte
 * lane). ACC3(a, b, c) is a ^ b ^ c. G is a literal, so the compiler unrolls the p loops and keeps
 * acc[] in registers. */
#define GF_NIBBLE_BODY(G, V, W, LOADU, STOREU, LOADT, ACC3, XOR2, AND, SHR4, SHUF, MASK, ZERO)            \
    do {                                                                                                \
        const V mask = MASK;                                                                            \
        for (size_t t = lo; t < hi; t += W) {                                                           \
            V acc[G];                                                                                   \
            for (int p = 0; p < G; p++)                                                                 \
                acc[p] = accumulate ? LOADU(out[p] + t) : ZERO;                                         \
            for (int j = 0; j < k; j++) {                                                               \
                V x = LOADU(in[j] + t);                                                                 \
                __builtin_prefetch(in[j] + t + 2048);                                                   \
                V xl = AND(x, mask), xh = AND(SHR4(x), mask);                                           \
                const uint8_t *tj = tabs + (size_t)j * (G) * 2 * (W), *oj = ones + (size_t)j * (G);    \
                for (int p = 0; p < G; p++)                                                             \
                    acc[p] = oj[p] ? XOR2(acc[p], x)                                                    \
                                   : ACC3(acc[p], SHUF(LOADT(tj + 2 * p * (W)), xl), SHUF(LOADT(tj + (2 * p + 1) * (W)), xh)); \
            }                                                                                           \
            for (int p = 0; p < G; p++)                                                                 \
                STOREU(out[p] + t, acc[p], nt);                                                         \
        }                                                                                               \
    } while (0)

/* The same with one GFNI affine transform per coefficient (tables: one uint64 matrix each). */
#define GF_AFFINE_BODY(G, V, W, LOADU, STOREU, BCAST, XOR, AFFINE, ZERO)                                   \
    do {                                                                                                \
        const uint64_t *mats = (const uint64_t *)(const void *)tabs;                                    \
        for (size_t t = lo; t < hi; t += W) {                                                           \
            V acc[G];                                                                                   \
            for (int p = 0; p < G; p++)                                                                 \
                acc[p] = accumulate ? LOADU(out[p] + t) : ZERO;                                         \
            for (int j = 0; j < k; j++) {                                                               \
                V x = LOADU(in[j] + t);                                                                 \
                __builtin_prefetch(in[j] + t + 2048);                                                   \
                for (int p = 0; p < G; p++)                                                             \
                    acc[p] = XOR(acc[p], AFFINE(x, BCAST(mats[(size_t)j * (G) + p])));                  \
            }                                                                                           \
            for (int p = 0; p < G; p++)                                                                 \
                STOREU(out[p] + t, acc[p], nt);                                                         \
        }                                                                                               \
    } while (0)

/* A pass function: g (1..gmax) picks a body compiled for that literal row count. FENCE orders
 * non-temporal stores before whatever the caller (or another thread) does next. */
#define GF_PASS(NAME, ATTR, BODY)                                                                        \
    static ATTR void NAME(const uint8_t *tabs, int g, int k, const uint8_t *const *in, uint8_t *const *out, \
                          size_t lo, size_t hi, int accumulate, int nt, const uint8_t *ones)            \
    {                                                                                                   \
        switch (g) {                                                                                    \
        case 1: BODY(1); break;                                                                         \
        case 2: BODY(2); break;                                                                         \
        case 3: BODY(3); break;                                                                         \
        case 4: BODY(4); break;                                                                         \
        GF_PASS_WIDE(BODY)                                                                              \
        }                                                                                               \
        GF_FENCE(nt);                                                                                   \
    }
#define GF_CASES_5_8(BODY)                                                                              \
    case 5: BODY(5); break;                                                                             \
    case 6: BODY(6); break;                                                                             \
    case 7: BODY(7); break;                                                                             \
    case 8: BODY(8); break;
#define GF_NO_WIDE(BODY)
#ifdef GF_X86
#define LD128(p) _mm_loadu_si128((const __m128i *)(const void *)(p))
#define GF_FENCE(nt) do { if (nt) _mm_sfence(); } while (0)
#define ST128(p, v, nt) ((nt) ? _mm_stream_si128((__m128i *)(void *)(p), (v)) : _mm_storeu_si128((__m128i *)(void *)(p), (v)))
#define LT128(p) _mm_load_si128((const __m128i *)(const void *)(p))
#define X3_128(a, b, c) _mm_xor_si128((a), _mm_xor_si128((b), (c)))
#define SSSE3_BODY(G) GF_NIBBLE_BODY(G, __m128i, 16, LD128, ST128, LT128, X3_128, _mm_xor_si128, _mm_and_si128, \
    SR4_128, _mm_shuffle_epi8, _mm_set1_epi8(0x0f), _mm_setzero_si128())
#define SR4_128(x) _mm_srli_epi16((x), 4)
#define GF_PASS_WIDE GF_NO_WIDE
GF_PASS(pass_ssse3, __attribute__((target("ssse3"))), SSSE3_BODY)

#define LD256(p) _mm256_loadu_si256((const __m256i *)(const void *)(p))
#define ST256(p, v, nt) ((nt) ? _mm256_stream_si256((__m256i *)(void *)(p), (v)) : _mm256_storeu_si256((__m256i *)(void *)(p), (v)))
#define LT256(p) _mm256_load_si256((const __m256i *)(const void *)(p))
#define X3_256(a, b, c) _mm256_xor_si256((a), _mm256_xor_si256((b), (c)))
#define SR4_256(x) _mm256_srli_epi16((x), 4)
#define AVX2_BODY(G) GF_NIBBLE_BODY(G, __m256i, 32, LD256, ST256, LT256, X3_256, _mm256_xor_si256, _mm256_and_si256, \
    SR4_256, _mm256_shuffle_epi8, _mm256_set1_epi8(0x0f), _mm256_setzero_si256())
GF_PASS(pass_avx2, __attribute__((target("avx2"))), AVX2_BODY)

#define BC256(a) _mm256_set1_epi64x((long long)(a))
#define AF256(x, a) _mm256_gf2p8affine_epi64_epi8((x), (a), 0)
#define GFNI256_BODY(G) GF_AFFINE_BODY(G, __m256i, 32, LD256, ST256, BC256, _mm256_xor_si256, AF256, \
    _mm256_setzero_si256())
GF_PASS(pass_gfni256, __attribute__((target("avx2,gfni"))), GFNI256_BODY)

/* AVX-512: 32 registers hold 8 outputs; VPTERNLOGQ (0x96: a ^ b ^ c) merges both lookups at once. */
#undef GF_PASS_WIDE
#define GF_PASS_WIDE GF_CASES_5_8
#define LD512(p) _mm512_loadu_si512((const void *)(p))
#define ST512(p, v, nt) ((nt) ? _mm512_stream_si512((__m512i *)(void *)(p), (v)) : _mm512_storeu_si512((void *)(p), (v)))
#define LT512(p) _mm512_load_si512((const void *)(p))
#define X3_512(a, b, c) _mm512_ternarylogic_epi64((a), (b), (c), 0x96)
#define SR4_512(x) _mm512_srli_epi16((x), 4)
#define AVX512_BODY(G) GF_NIBBLE_BODY(G, __m512i, 64, LD512, ST512, LT512, X3_512, _mm512_xor_si512, _mm512_and_si512, \
    SR4_512, _mm512_shuffle_epi8, _mm512_set1_epi8(0x0f), _mm512_setzero_si512())
GF_PASS(pass_avx512, __attribute__((target("avx512f,avx512bw"))), AVX512_BODY)

#define BC512(a) _mm512_set1_epi64((long long)(a))
#define AF512(x, a) _mm512_gf2p8affine_epi64_epi8((x), (a), 0)
#define GFNI512_BODY(G) GF_AFFINE_BODY(G, __m512i, 64, LD512, ST512, BC512, _mm512_xor_si512, AF512, \
    _mm512_setzero_si512())
GF_PASS(pass_gfni512, __attribute__((target("avx512f,avx512bw,gfni"))), GFNI512_BODY)

/* GFNI has no __builtin_cpu_supports name in older compilers: CPUID leaf 7, ECX bit 8. The
 * vector state it needs (AVX/AVX-512) is checked by the other feature names, which include the
 * operating system's support (XGETBV). */
static int
cpu_gfni(void)
{
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (c & (1u << 8));
}
static int has_ssse3(void) { return __builtin_cpu_supports("ssse3"); }
static int has_avx2(void) { return __builtin_cpu_supports("avx2"); }
static int has_avx512(void) { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }
static int has_gfni256(void) { return has_avx2() && cpu_gfni(); }
static int has_gfni512(void) { return has_avx512() && cpu_gfni(); }
#endif /* GF_X86 */

#ifdef GF_NEON
/* NEON is part of every aarch64 CPU: no run-time check. TBL gives 0 for indices >= 16, so the
 * high nibble needs no mask; the AND is kept for one body shared with x86. */
#define LDN(p) vld1q_u8((const uint8_t *)(p))
#define STN(p, v, nt) vst1q_u8((uint8_t *)(p), (v)) /* nt is never set here (stream = 0) */
#define GF_FENCE(nt) (void)(nt)
#define X3N(a, b, c) veorq_u8((a), veorq_u8((b), (c)))
#define SR4N(x) vshrq_n_u8((x), 4)
#define NEON_BODY(G) GF_NIBBLE_BODY(G, uint8x16_t, 16, LDN, STN, LDN, X3N, veorq_u8, vandq_u8, SR4N, vqtbl1q_u8, \
    vdupq_n_u8(0x0f), vdupq_n_u8(0))
#define GF_PASS_WIDE GF_CASES_5_8
GF_PASS(pass_neon, , NEON_BODY)
static int has_neon(void) { return 1; }
#endif

static int has_nothing_special(void) { return 1; }
/* Best first: "auto" takes the first one the CPU has. */
static const struct gf_isa isas[] = {
#ifdef GF_X86
    {"gfni", pass_gfni512, 64, 8, 1, 1, has_gfni512},
    {"avx512", pass_avx512, 64, 8, 0, 1, has_avx512},
    {"gfni-avx2", pass_gfni256, 32, 4, 1, 1, has_gfni256},
    {"avx2", pass_avx2, 32, 4, 0, 1, has_avx2},
    {"ssse3", pass_ssse3, 16, 4, 0, 1, has_ssse3},
#endif
#ifdef GF_NEON
    {"neon", pass_neon, 16, 8, 0, 0, has_neon},
#endif
    {"scalar", NULL, 1, 1, 0, 0, has_nothing_special},
};
#define N_ISAS (sizeof isas / sizeof isas[0])

static const struct gf_isa *gf_cur; /* NULL until gf_select; read without the GIL */

static const struct gf_isa *
current(void)
{
#ifdef __GNUC__
    const struct gf_isa *isa = __atomic_load_n(&gf_cur, __ATOMIC_ACQUIRE);
#else
    const struct gf_isa *isa = gf_cur;
#endif
    return isa ? isa : &isas[N_ISAS - 1];
}

int
gf_select(const char *name)
{
    const struct gf_isa *pick = NULL;
    int known = 0;
#ifdef GF_X86
    __builtin_cpu_init();
#endif
    for (size_t i = 0; i < N_ISAS && !pick; i++) {
        int auto_ = strcmp(name, "auto") == 0;
        if (!auto_ && strcmp(name, isas[i].name) != 0)
            continue;
        known = 1;
        if (isas[i].cpu_has())
            pick = &isas[i];
        else if (!auto_)
            return 0;
    }
    if (!pick) { /* a path of another architecture is "not here", not "unknown" */
        static const char *const all[] = {"gfni", "avx512", "gfni-avx2", "avx2", "ssse3", "neon", "scalar"};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            known |= strcmp(name, all[i]) == 0;
        return known ? 0 : -1;
    }
#ifdef __GNUC__
    __atomic_store_n(&gf_cur, pick, __ATOMIC_RELEASE);
#else
    gf_cur = pick;
#endif
    return 1;
}

const char *
gf_isa_name(void)
{
    return current()->name;
}

int
gf_matmul(const uint8_t *mat, int m, int k, const uint8_t *const *in, uint8_t *const *out, size_t n,
          int accumulate)
{
    const struct gf_isa *isa = current();
    size_t w = isa->width, head = 0, nvec;
    int nt = 0;
    if (m <= 0)
        return 0;
    if (isa->stream && !accumulate && n * (size_t)(k + m) >= GF_STREAM_MIN) {
        size_t mis = (uintptr_t)out[0] % w; /* streaming stores need aligned addresses */
        nt = 1;
        for (int i = 1; i < m; i++)
            nt &= (uintptr_t)out[i] % w == mis;
        head = nt ? (w - mis) % w : 0;
    }
    nvec = isa->pass ? (n - head) - (n - head) % w : 0; /* vector bytes, from head on */
    if (nvec) {
        int gmax = isa->gmax;
        size_t per = isa->affine ? 8 : 2 * w; /* table bytes per coefficient */
        size_t bytes = (size_t)m * (size_t)k * per;
        unsigned char *raw = malloc(bytes + 64 + (size_t)m * k); /* tables 64-byte aligned: aligned loads */
        if (!raw)
            return -1;
        uint8_t *tabs = (uint8_t *)(((uintptr_t)raw + 63) & ~(uintptr_t)63), *ones = tabs + bytes;
        for (int r0 = 0; r0 < m; r0 += gmax) { /* per pass: [input j][output p][table] */
            int g = m - r0 < gmax ? m - r0 : gmax;
            uint8_t *base = tabs + (size_t)r0 * k * per;
            for (int j = 0; j < k; j++)
                for (int p = 0; p < g; p++) {
                    uint8_t c = mat[(size_t)(r0 + p) * k + j], *dst = base + ((size_t)j * g + p) * per;
                    ones[(size_t)r0 * k + (size_t)j * g + p] = c == 1; /* a plain XOR, no lookup */
                    if (isa->affine) {
                        uint64_t a = affine_matrix(c);
                        memcpy(dst, &a, 8);
                    } else {
                        for (size_t h = 0; h < w; h++) {
                            dst[h] = gf_mul_tab[c][h & 15];
                            dst[w + h] = gf_mul_tab[c][(h & 15) << 4];
                        }
                    }
                }
        }
        /* Several passes re-read the inputs: chunks of them (about 192 KiB with the outputs) stay in L2. */
        size_t chunk = nvec, end = head + nvec;
        if (m > gmax) {
            chunk = ((size_t)192 << 10) / (size_t)(k + gmax) / 1024 * 1024;
            chunk = chunk < 1024 ? 1024 : chunk;
        }
        for (size_t lo = head; lo < end; lo += chunk) {
            size_t hi = end - lo < chunk ? end : lo + chunk;
            for (int r0 = 0; r0 < m; r0 += gmax) {
                int g = m - r0 < gmax ? m - r0 : gmax;
                isa->pass(tabs + (size_t)r0 * k * per, g, k, in, out + r0, lo, hi, accumulate, nt, ones + (size_t)r0 * k);
            }
        }
        free(raw);
    } else
        head = 0; /* no vector part: the scalar code does it all */
    scalar_range(mat, m, k, in, out, 0, head, accumulate);
    scalar_range(mat, m, k, in, out, head + nvec, n, accumulate);
    return 0;
}
