/* make_dcp_old.c -- ours (ftidask): drives FTI_WritePosixDcp of FTI's src/diff-checkpoint-posix.c (commit 042fdb56,
 * the unsigned long layout; compiled out of this repository) for one rank: four dCP checkpoints, block size 512,
 * stack size 2, MD5; after each it copies the file, writes the meta file with the keys FTI's meta.c of the time
 * writes for it, and dumps each variable's bytes (OUT/ckpt{k}/). Build: see ../README.md. */
#include <sys/stat.h>
#include "old_stub.h"

void FTI_Print(char *msg, int priority) { if (priority >= FTI_WARN) fprintf(stderr, "FTI: %s\n", msg); }
char *hashHex(const unsigned char *hash, int digestWidth, char *out) {
    static char buf[MD5_DIGEST_STRING_LENGTH];
    if (!out) out = buf;
    for (int i = 0; i < digestWidth; i++) snprintf(&out[2 * i], 3, "%02x", hash[i]);
    return out;
}
static unsigned char *md5_hash(const unsigned char *d, unsigned long n, unsigned char *h) { return MD5(d, n, h); }
static void dump(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb"); if (!f || fwrite(p, 1, n, f) != n) { perror(path); exit(1); } fclose(f);
}

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    char dir[FTI_BUFS], path[FTI_BUFS * 2], cmd[FTI_BUFS * 3];
    snprintf(dir, sizeof dir, "%s/dCP", argv[1]);
    snprintf(cmd, sizeof cmd, "mkdir -p %s", dir);
    if (system(cmd)) return 1;
    FTIT_configuration conf = {{MD5_DIGEST_LENGTH, md5_hash, 512, 2}};
    FTIT_execution exec = {0};
    FTIT_topology topo = {0, 0};
    FTIT_checkpoint ckpt[5] = {{{0}}};
    snprintf(ckpt[4].dcpDir, FTI_BUFS, "%s", dir); ckpt[4].isInline = 1;
    /* id 3: double[100] (800 bytes: one block and a partial one), id 5: int16_t[700] (1400 bytes) */
    double *a = calloc(100, sizeof(double));
    int16_t *b = calloc(700, sizeof(int16_t));
    for (int i = 0; i < 100; i++) a[i] = 1.0 / (i + 1);
    for (int i = 0; i < 700; i++) b[i] = (int16_t)(i * 37 - 9000);
    FTIT_dataset data[2] = {{3, a, 800, {0, NULL, NULL}}, {5, b, 1400, {0, NULL, NULL}}};
    exec.nbVar = 2;
    for (int k = 1; k <= 4; k++) {
        if (k == 2) { a[90] = 42.0; b[600] = -1; }   /* blocks 1 of both (the partial ones) */
        if (k == 3) a[0] = 7.0;
        if (k == 4) b[10] = 10;
        exec.ckptID = 10 * k;
        if (FTI_WritePosixDcp(&conf, &exec, &topo, ckpt, data) != FTI_SCES) return 1;
        char snap[FTI_BUFS * 2];
        snprintf(snap, sizeof snap, "%s/ckpt%d", argv[1], k);
        mkdir(snap, 0777);
        snprintf(path, sizeof path, "cp %s/%s %s/", dir, exec.meta[0].ckptFile, snap);
        if (system(path)) return 1;
        for (int v = 0; v < 2; v++) {
            snprintf(path, sizeof path, "%s/var%d.bin", snap, data[v].id);
            dump(path, data[v].ptr, data[v].size);
        }
        /* the meta file: src/meta.c of the time (FTI_WriteMetadata with dCP) */
        snprintf(path, sizeof path, "%s/sector0-group0.fti", snap);
        FILE *m = fopen(path, "w");
        fprintf(m, "[ckpt_info]\n%-30s = %s\n%-30s = %d\n\n", "ckpt_type", "dcp", "ckpt_id", exec.ckptID);
        fprintf(m, "[0]\n%-30s = %s\n%-30s = %lu\n%-30s = %lu\n%-30s = %s\n", "ckpt_file_name",
                exec.meta[0].ckptFile, "ckpt_file_size", exec.dcpInfoPosix.FileSize, "ckpt_file_maxs",
                exec.dcpInfoPosix.FileSize, "ckpt_checksum", "00000000000000000000000000000000");
        char key[64];
        for (int v = 0; v < 2; v++) {
            snprintf(key, sizeof key, "var%d_id", v); fprintf(m, "%-30s = %d\n", key, data[v].id);
            snprintf(key, sizeof key, "var%d_size", v); fprintf(m, "%-30s = %ld\n", key, data[v].size);
        }
        int nbLayer = ((exec.dcpInfoPosix.Counter - 1) % conf.dcpInfoPosix.StackSize) + 1;
        for (int j = 0; j < nbLayer; j++) {
            snprintf(key, sizeof key, "dcp_layer%d_size", j);
            fprintf(m, "%-30s = %lu\n", key, exec.dcpInfoPosix.LayerSize[j]);
            snprintf(key, sizeof key, "dcp_layer%d_hash", j);
            fprintf(m, "%-30s = %s\n", key, &exec.dcpInfoPosix.LayerHash[j * MD5_DIGEST_STRING_LENGTH]);
        }
        fprintf(m, "\n");
        fclose(m);
        printf("ckpt %d: %s layer %d, file %lu bytes\n", k, exec.meta[0].ckptFile, nbLayer - 1,
               exec.dcpInfoPosix.FileSize);
    }
    return 0;
}
