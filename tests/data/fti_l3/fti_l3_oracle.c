/* Out-of-repository oracle for FTI's level-3 Reed-Solomon parity (ours; see README.md beside it).
 *
 * Follows the arithmetic of FTI_RSenc (leobago/fti src/postckpt.c, FTI 1.3/1.4 with FTI-FF) for one group of
 * K ranks, all simulated in this one process, with Jerasure 2.0 (GF-Complete backend, the library FTI ships in
 * deps/jerasure): per block of BS bytes, every buffer zeroed, each rank's REMBSIZE bytes read, rank g's parity
 * row computed from the K blocks in FTI's ring order (starting at its own block) with matrix[g][i] =
 * galois_single_divide(1, g ^ (K + i), 16), memcpy/galois_region_xor for a factor of 1 and
 * galois_w16_region_multiply otherwise, over the whole BS bytes; REMBSIZE parity bytes written.
 * With --ftiff the rank files are first padded as FTI_RSenc pads an FTI-FF file: zeros up to MAXFS and the file's
 * size (off_t, native order) in its last 8 bytes.
 * It then decodes every erasure pattern of 1..K of the 2K files as FTI_Decode (src/postreco.c) does
 * (jerasure_invert_matrix on the rows of the first K survivors, jerasure_matrix_dotprod over BS bytes) and checks
 * that each lost file comes back; it exits 1 if one does not (but for byte maxFs - 1 of an odd maxFs: counted).
 *
 * usage: fti_l3_oracle [--ftiff] BS MAXFS OUTDIR RANKFILE0 .. RANKFILE{K-1}   (writes OUTDIR/parity{g}.bin)
 * build: gcc -O2 -o fti_l3_oracle fti_l3_oracle.c -I/usr/include/jerasure -lJerasure -lgf_complete
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include "jerasure.h"
#include "galois.h"

#define W 16

static char *load_padded(const char *path, long maxfs, int ftiff) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(2); }
    char *buf = calloc(maxfs, 1);  /* truncate(lfn, maxFs): zeros past the file */
    long n = fread(buf, 1, maxfs, f);
    fclose(f);
    if (ftiff) {
        off_t size = n;  /* FTI_RSenc: stat's st_size written at maxFs - sizeof(off_t) */
        if (n > maxfs - (long)sizeof(off_t)) { fprintf(stderr, "%s: no room for the size\n", path); exit(2); }
        memcpy(buf + maxfs - sizeof(off_t), &size, sizeof(off_t));
    }
    return buf;
}

int main(int argc, char **argv) {
    int ftiff = 0, a = 1;
    if (argc > 1 && strcmp(argv[1], "--ftiff") == 0) { ftiff = 1; a++; }
    if (argc - a < 5) { fprintf(stderr, "usage: %s [--ftiff] BS MAXFS OUTDIR RANKFILE...\n", argv[0]); return 2; }
    int bs = atoi(argv[a]);
    long maxfs = atol(argv[a + 1]);
    const char *out = argv[a + 2];
    int k = argc - a - 3;
    char **file = malloc(sizeof(char *) * 2 * k);
    for (int g = 0; g < k; g++) file[g] = load_padded(argv[a + 3 + g], maxfs, ftiff);
    int *matrix = malloc(sizeof(int) * k * k);
    for (int i = 0; i < k; i++)
        for (int j = 0; j < k; j++) matrix[i * k + j] = galois_single_divide(1, i ^ (k + j), W);
    long ps = (maxfs / bs) * bs;
    if (ps < maxfs) ps += bs;

    /* encode: FTI_RSenc on each rank g */
    char *data = malloc(bs), *coding = malloc(bs);
    for (int g = 0; g < k; g++) {
        file[k + g] = calloc(maxfs, 1);
        int rem = bs;
        for (long pos = 0; pos < ps; pos += bs) {
            if (maxfs - pos < bs) rem = maxfs - pos;
            memset(coding, 0, bs);
            int init = 0, i = g;
            for (int cnt = 0; cnt < k; cnt++) {
                memset(data, 0, bs);  /* bzero(data, 2*bs); the block received is rem bytes */
                memcpy(data, file[i] + pos, rem);
                int v = matrix[g * k + i];
                if (v == 1) {
                    if (!init) { memcpy(coding, data, bs); init = 1; }
                    else galois_region_xor(data, coding, bs);
                }
                if (v != 0 && v != 1) { galois_w16_region_multiply(data, v, bs, coding, init); init = 1; }
                i = (i + 1) % k;
            }
            memcpy(file[k + g] + pos, coding, rem);  /* fwrite(coding, 1, remBsize, efd) */
        }
        char name[4096];
        snprintf(name, sizeof name, "%s/parity%d.bin", out, g);
        FILE *f = fopen(name, "wb");
        if (!f || fwrite(file[k + g], 1, maxfs, f) != (size_t)maxfs) { perror(name); return 2; }
        fclose(f);
    }

    /* decode: FTI_Decode for every pattern of 1..k erasures among the 2k files */
    char **dptr = malloc(sizeof(char *) * k), **cptr = malloc(sizeof(char *) * k);
    for (int i = 0; i < k; i++) { dptr[i] = malloc(bs); cptr[i] = malloc(bs); }
    int *tmpmat = malloc(sizeof(int) * k * k), *dec = malloc(sizeof(int) * k * k), *ids = malloc(sizeof(int) * k);
    int patterns = 0, bad = 0, last = 0;
    for (int mask = 1; mask < (1 << (2 * k)); mask++) {
        if (__builtin_popcount(mask) > k) continue;
        int j = 0;
        for (int i = 0; j < k; i++) if (!(mask >> i & 1)) ids[j++] = i;
        for (int i = 0; i < k; i++) {
            for (j = 0; j < k; j++) tmpmat[i * k + j] = ids[i] < k ? (j == ids[i]) : matrix[(ids[i] - k) * k + j];
        }
        if (jerasure_invert_matrix(tmpmat, dec, k, W) < 0) { printf("mask %x: not invertible\n", mask); bad++; continue; }
        int rem = bs;
        for (long pos = 0; pos < ps; pos += bs) {
            if (maxfs - pos < bs) rem = maxfs - pos;
            for (int i = 0; i < k; i++) {  /* bzero, then rem bytes read from each file still there */
                memset(dptr[i], 0, bs); memset(cptr[i], 0, bs);
                if (!(mask >> i & 1)) memcpy(dptr[i], file[i] + pos, rem);
                if (!(mask >> (k + i) & 1)) memcpy(cptr[i], file[k + i] + pos, rem);
            }
            for (int r = 0; r < k; r++)
                if (mask >> r & 1) jerasure_matrix_dotprod(k, W, dec + r * k, ids, r, dptr, cptr, bs);
            for (int r = 0; r < k; r++)
                if (mask >> (k + r) & 1) jerasure_matrix_dotprod(k, W, matrix + r * k, NULL, k + r, dptr, cptr, bs);
            /* an odd maxFs leaves the high byte of the last word out of the parity file (only maxFs bytes are
               written): that word then decodes wrong, its byte maxFs - 1 counted apart (last) */
            int odd_end = (maxfs & 1) && pos + rem == maxfs;
            for (int r = 0; r < 2 * k; r++) {
                char *got = r < k ? dptr[r] : cptr[r - k];
                if (!(mask >> r & 1) || !memcmp(got, file[r] + pos, rem)) continue;
                if (odd_end && !memcmp(got, file[r] + pos, rem - 1)) last++;
                else bad++;
            }
        }
        patterns++;
    }
    printf("k=%d bs=%d maxFs=%ld%s: %d erasure patterns decoded, %d mismatches, %d files wrong in byte maxFs-1 "
           "only\n", k, bs, maxfs, ftiff ? " (FTI-FF padding)" : "", patterns, bad, last);
    return bad != 0;
}
