/* GF(2^8) matrix-times-stripes kernel of ftidask's Reed-Solomon codec (see gf256.c). */
#ifndef FTIDASK_GF256_H
#define FTIDASK_GF256_H

#include <stddef.h>
#include <stdint.h>

#define GF_MAX_ROWS 256 /* m and k are at most 256: a GF(2^8) code never needs more */

/* Build the product table; call once before anything else (module init). */
void gf_init(void);

/* out[i] (= or ^=) XOR_j mat[i * k + j] * in[j], bytes 0..n-1, for i < m, j < k.
 * No buffer may overlap an output (the caller checks). Returns 0, or -1 when out of memory.
 * Safe to call from several threads at once; needs no GIL. */
int gf_matmul(const uint8_t *mat, int m, int k, const uint8_t *const *in, uint8_t *const *out, size_t n,
              int accumulate);

/* Select the code path by name ("auto" for the best the CPU has): 1 done, 0 the CPU (or this
 * build) lacks it, -1 unknown name. gf_isa_name() is the one in use. */
int gf_select(const char *name);
const char *gf_isa_name(void);

#endif
