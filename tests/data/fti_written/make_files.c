/* make_files.c - writes the FTI-FF files pinned in tests/data/fti_written/.
 *
 * Built against FTI's FTI-FF writer (src/IO/ftiff.c of leobago/fti 196f77d2, transcribed;
 * see README.md) through a small front end with FTI's calling order. With -DREAL_FTI it uses
 * FTI's own API instead (FTI_Init with config.fti: ckpt_io = 3, head = 0, local_test = 1).
 *
 * Each rank protects five variables of different FTI types and checkpoints three times:
 *   ckpt 1, L1: the first layout (one block, one container per variable);
 *   ckpt 2, L1: B grows 8 -> 14 doubles (a new container in an appended block), C shrinks 40 -> 24;
 *   ckpt 3, L4: B shrinks 14 -> 5 (its appended container is left empty), C grows 24 -> 50 (a
 *               third block).
 * After each checkpoint it writes the bytes each variable held to OUT/expected/ckpt<N>/rank<R>/var<ID>.bin.
 * It never calls FTI_Finalize, so every file stays where FTI put it.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#ifdef REAL_FTI
#include <fti.h>
#else
#include "fti_shim.h"
#endif

typedef struct { int a; double b; } pair_t;   /* 16 bytes: int, 4 padding bytes, double */

static char outdir[512];
static int rank;

static void dump(int ckpt, int id, const void *p, size_t n) {
    char path[1024];
    snprintf(path, sizeof path, "mkdir -p %s/expected/ckpt%d/rank%d", outdir, ckpt, rank);
    if (system(path)) exit(1);
    snprintf(path, sizeof path, "%s/expected/ckpt%d/rank%d/var%d.bin", outdir, ckpt, rank, id);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n) { perror(path); exit(1); }
    fclose(f);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    snprintf(outdir, sizeof outdir, "%s", argc > 1 ? argv[1] : "out");
#ifdef REAL_FTI
    FTI_Init(argc > 2 ? argv[2] : "config.fti", MPI_COMM_WORLD);
    FTIT_type pairType;
    FTI_InitType(&pairType, sizeof(pair_t));
#define PROTECT(id, p, n, T) FTI_Protect(id, p, n, T)
#define CKPT(id, lvl) FTI_Checkpoint(id, lvl)
#define T_INT FTI_INTG
#define T_DBL FTI_DBLE
#define T_CHR FTI_CHAR
#define T_LNG FTI_LONG
#define T_PAIR pairType
#else
    FTIS_Init(outdir);
#define PROTECT(id, p, n, T) FTIS_Protect(id, p, n, T)
#define CKPT(id, lvl) FTIS_Checkpoint(id, lvl)
#define T_INT ((long)sizeof(int))
#define T_DBL ((long)sizeof(double))
#define T_CHR ((long)sizeof(char))
#define T_LNG ((long)sizeof(long))
#define T_PAIR ((long)sizeof(pair_t))
#endif
    int i, nA = 16, nB = 8, nC = 40, nD = 6, nE = 4;
    int *A = malloc(nA * sizeof(int));
    double *B = malloc(nB * sizeof(double));
    char *C = malloc(nC);
    long *D = malloc(nD * sizeof(long));
    pair_t *E = malloc(nE * sizeof(pair_t));
    memset(E, 0xAB, nE * sizeof(pair_t));       /* fixes the padding bytes FTI copies too */
    for (i = 0; i < nA; i++) A[i] = i * 7 - 3 + 1000 * rank;
    for (i = 0; i < nB; i++) B[i] = 0.5 * i + rank - 1.0 / 3.0;
    for (i = 0; i < nC; i++) C[i] = (char)('A' + (i + rank) % 26);
    for (i = 0; i < nD; i++) D[i] = 1L << (8 * i + rank);
    for (i = 0; i < nE; i++) { E[i].a = -i - 10 * rank; E[i].b = i * 1.25e-3; }
    PROTECT(0, A, nA, T_INT);
    PROTECT(1, B, nB, T_DBL);
    PROTECT(2, C, nC, T_CHR);
    PROTECT(3, D, nD, T_LNG);
    PROTECT(4, E, nE, T_PAIR);
    CKPT(1, 1);
    dump(1, 0, A, nA * sizeof(int)); dump(1, 1, B, nB * sizeof(double)); dump(1, 2, C, nC);
    dump(1, 3, D, nD * sizeof(long)); dump(1, 4, E, nE * sizeof(pair_t));

    /* ckpt 2: B grows, C shrinks, A changes */
    nB = 14; B = realloc(B, nB * sizeof(double));
    for (i = 0; i < nB; i++) B[i] = -2.0 * i + 0.125 + rank;
    nC = 24;
    for (i = 0; i < nC; i++) C[i] = (char)('a' + (i * 3 + rank) % 26);
    for (i = 0; i < nA; i++) A[i] += 1;
    PROTECT(1, B, nB, T_DBL);
    PROTECT(2, C, nC, T_CHR);
    CKPT(2, 1);
    dump(2, 0, A, nA * sizeof(int)); dump(2, 1, B, nB * sizeof(double)); dump(2, 2, C, nC);
    dump(2, 3, D, nD * sizeof(long)); dump(2, 4, E, nE * sizeof(pair_t));

    /* ckpt 3 (L4): B shrinks below its first container, C grows past it */
    nB = 5;
    for (i = 0; i < nB; i++) B[i] = 100.0 + i + rank;
    nC = 50; C = realloc(C, nC);
    for (i = 0; i < nC; i++) C[i] = (char)('0' + (i + rank) % 10);
    for (i = 0; i < nD; i++) D[i] = -D[i];
    PROTECT(1, B, nB, T_DBL);
    PROTECT(2, C, nC, T_CHR);
    CKPT(3, 4);
    dump(3, 0, A, nA * sizeof(int)); dump(3, 1, B, nB * sizeof(double)); dump(3, 2, C, nC);
    dump(3, 3, D, nD * sizeof(long)); dump(3, 4, E, nE * sizeof(pair_t));

    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Finalize();   /* no FTI_Finalize: the checkpoint files stay */
    return 0;
}
