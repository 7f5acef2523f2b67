/* make_dcp.c -- ours (ftidask): drives FTI's dCP-POSIX writer (FTI_InitDCPPosix, FTI_WritePosixDCPData,
 * FTI_PosixDCPClose, compiled from FTI's src/IO/posix-dcp.c outside this repository) as FTI_Checkpoint does for
 * an L4 dCP checkpoint with inline L4 (the file goes straight to the global dCP directory), for one rank, five
 * checkpoints, dcp_block_size = 512, dcp_stack_size = 3, dcp_mode MD5. After each checkpoint it copies the dCP
 * file, writes the meta file with the keys and values FTI_WriteMetadata (src/meta.c) writes for it, and dumps each
 * variable's bytes: OUT/ckpt{k}/{dcp file, sector0-group0.fti, var{id}.bin}.  Build: see README.md. */
#include <sys/stat.h>
#include <unistd.h>
#include "fti_stub.h"

void FTI_Print(char *msg, int priority) { if (priority >= FTI_WARN) fprintf(stderr, "FTI: %s\n", msg); }
int FTI_Try(int result, char *message) { (void)message; return result; }
/* FTI's POSIX open (src/IO/posix.c): fopen with the flag ('w' or 'a', binary), and a fresh MD5 context */
int FTI_PosixOpen(char *fn, WritePosixInfo_t *info) {
    info->f = fopen(fn, info->flag == 'w' ? "wb" : "ab");
    if (!info->f) { perror(fn); exit(1); }
    MD5_Init(&info->integrity);
    return FTI_SCES;
}
int FTI_PosixSync(WritePosixInfo_t *info) { fflush(info->f); fsync(fileno(info->f)); return FTI_SCES; }
int FTI_PosixClose(WritePosixInfo_t *info) { fclose(info->f); return FTI_SCES; }
int FTI_CLOSE_ASYNC(FILE *f) { (void)f; return 1; }
/* without GPU support FTI's prefetcher hands over the whole variable once (fetchSize = size), then NULL */
int FTI_InitPrefetcher(FTIT_data_prefetch *p) { p->done = 0; return FTI_SCES; }
int FTI_getPrefetchedData(FTIT_data_prefetch *p, size_t *size, unsigned char **ptr) {
    if (p->done || p->totalBytesToFetch == 0) { *size = 0; *ptr = NULL; return FTI_SCES; }
    p->done = 1; *size = p->totalBytesToFetch; *ptr = p->dptr; return FTI_SCES;
}
int FTI_MD5GPU(FTIT_dataset *data) { (void)data; return 1; }
int FTI_startMD5(void) { return FTI_SCES; }
int FTI_SyncMD5(void) { return FTI_SCES; }
char *FTI_GetHashHexStr(unsigned char *hash, int digestWidth, char *out) {
    static char buf[MD5_DIGEST_STRING_LENGTH];
    if (!out) out = buf;
    for (int i = 0; i < digestWidth; i++) snprintf(&out[2 * i], 3, "%02x", hash[i]);
    return out;
}
static unsigned char *md5_hash(const unsigned char *d, unsigned long n, unsigned char *h) { return MD5(d, n, h); }

#define NVAR 3
static FTIT_dataset vars[NVAR];
static int keymap_data(FTIT_dataset **out, int n) { (void)n; *out = vars; return FTI_SCES; }

static void dump(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb"); if (!f || fwrite(p, 1, n, f) != n) { perror(path); exit(1); } fclose(f);
}
static void copy(const char *from, const char *to) {
    FILE *f = fopen(from, "rb"); if (!f) { perror(from); exit(1); }
    fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(n ? n : 1); if (fread(b, 1, n, f) != (size_t)n) exit(1); fclose(f);
    dump(to, b, n); free(b);
}

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: make_dcp OUT\n"); return 2; }
    const char *out = argv[1];
    char dir[FTI_BUFS], path[FTI_BUFS * 2], path2[FTI_BUFS * 3];
    snprintf(dir, sizeof dir, "%s/run/glbl/20260101-000000/dCP", out);
    snprintf(path, sizeof path, "mkdir -p %s", dir);
    if (system(path)) return 1;

    FTIT_configuration conf = {0};
    conf.dcpInfoPosix.BlockSize = 512; conf.dcpInfoPosix.StackSize = 3;
    conf.dcpInfoPosix.digestWidth = MD5_DIGEST_LENGTH; conf.dcpInfoPosix.hashFunc = md5_hash;
    FTIT_execution exec = {0};
    FTIT_topology topo = {0};
    FTIT_checkpoint ckpt[5] = {{{0}}};
    snprintf(ckpt[4].dcpDir, FTI_BUFS, "%s", dir); ckpt[4].isInline = 1;
    snprintf(ckpt[1].dcpDir, FTI_BUFS, "%s/run/local/20260101-000000/dCP", out);
    FTIT_keymap keymap = {vars, keymap_data};

    /* id 0: double[300] (2400 bytes: 4 blocks and a partial one), id 1: int32[256] (1024: 2 whole blocks),
     * id 1000: uint8, 700 bytes, grown to 1300 at checkpoint 3, shrunk to 600 at checkpoint 5 */
    const int ids[NVAR] = {0, 1, 1000};
    double *a = calloc(300, sizeof(double));
    int32_t *b = calloc(256, sizeof(int32_t));
    uint8_t *c = calloc(1300, 1);
    for (int i = 0; i < 300; i++) a[i] = i * 0.5;
    for (int i = 0; i < 256; i++) b[i] = -i * 3;
    for (int i = 0; i < 1300; i++) c[i] = (uint8_t)(i * 7 + 1);
    void *ptrs[NVAR] = {a, b, c};
    size_t sizes[NVAR] = {2400, 1024, 700};
    for (int v = 0; v < NVAR; v++) {
        vars[v].id = ids[v]; vars[v].ptr = ptrs[v]; vars[v].size = sizes[v];
        vars[v].dcpInfoPosix.currentHashArray = calloc(16, 16);  /* room for 16 blocks' hashes */
        vars[v].dcpInfoPosix.oldHashArray = calloc(16, 16);
    }
    exec.nbVar = NVAR;

    for (int k = 1; k <= 5; k++) {
        /* the application's work between checkpoints */
        if (k == 2) { a[3] = -1.25; a[299] = 1e300; }                  /* blocks 0 and 4 (the partial one) */
        if (k == 3) { vars[2].size = 1300; b[200] = 77; }              /* c grows; b's block 1 */
        if (k == 4) { a[100] = 3.5; c[5] ^= 0xff; }
        if (k == 5) { vars[2].size = 600; c[550] = 0; a[70] = -0.0; }  /* c shrinks into its block 1 */

        exec.ckptId = k;
        void *fd = FTI_InitDCPPosix(&conf, &exec, &topo, ckpt, &keymap);
        for (int v = 0; v < NVAR; v++)
            if (FTI_WritePosixDCPData(&vars[v], fd) != FTI_SCES) return 1;
        FTI_PosixDCPClose(fd);

        char snap[FTI_BUFS * 2];
        snprintf(snap, sizeof snap, "%s/ckpt%d", out, k);
        mkdir(snap, 0777);
        snprintf(path, sizeof path, "%s/%s", dir, exec.ckptMeta.ckptFile);
        snprintf(path2, sizeof path2, "%s/%s", snap, exec.ckptMeta.ckptFile);
        copy(path, path2);
        for (int v = 0; v < NVAR; v++) {
            snprintf(path2, sizeof path2, "%s/var%d.bin", snap, ids[v]);
            dump(path2, vars[v].ptr, vars[v].size);
        }
        /* the meta file: the keys FTI_WriteMetadata writes for a dCP checkpoint, in its order, as iniparser
         * dumps them (lower case, "%-30s = %s") */
        snprintf(path2, sizeof path2, "%s/sector0-group0.fti", snap);
        FILE *m = fopen(path2, "w");
        fprintf(m, "[ckpt_info]\n%-30s = %s\n%-30s = %d\n\n", "ckpt_type", "dcp", "ckpt_id", k);
        fprintf(m, "[0]\n%-30s = %s\n", "ckpt_file_name", exec.ckptMeta.ckptFile);
        fprintf(m, "%-30s = %lu\n%-30s = %lu\n", "ckpt_file_size", exec.dcpInfoPosix.FileSize,
                "ckpt_file_maxs", exec.dcpInfoPosix.FileSize);
        fprintf(m, "%-30s = %s\n", "ckpt_checksum", "00000000000000000000000000000000");
        char key[64];
        for (int v = 0; v < NVAR; v++) {
            snprintf(key, sizeof key, "var%d_id", v); fprintf(m, "%-30s = %d\n", key, ids[v]);
            snprintf(key, sizeof key, "var%d_size", v); fprintf(m, "%-30s = %zu\n", key, vars[v].size);
        }
        int nbLayer = ((exec.dcpInfoPosix.Counter - 1) % conf.dcpInfoPosix.StackSize) + 1;
        for (int j = 0; j < nbLayer; j++) {
            snprintf(key, sizeof key, "dcp_layer%d_size", j);
            fprintf(m, "%-30s = %lu\n", key, exec.dcpInfoPosix.LayerSize[j]);
            snprintf(key, sizeof key, "dcp_layer%d_hash", j);
            fprintf(m, "%-30s = %s\n", key, &exec.dcpInfoPosix.LayerHash[j * MD5_DIGEST_STRING_LENGTH]);
            for (int v = 0; v < NVAR; v++) {
                snprintf(key, sizeof key, "dcp_layer%d_var%d_id", j, v); fprintf(m, "%-30s = %d\n", key, ids[v]);
                snprintf(key, sizeof key, "dcp_layer%d_var%d_size", j, v);
                fprintf(m, "%-30s = %zu\n", key, vars[v].size);
            }
        }
        fprintf(m, "\n");
        fclose(m);
        printf("ckpt %d: %s layer %d, file %lu bytes, layer size %lu, hash %s\n", k, exec.ckptMeta.ckptFile,
               nbLayer - 1, exec.dcpInfoPosix.FileSize, exec.dcpInfoPosix.LayerSize[nbLayer - 1],
               &exec.dcpInfoPosix.LayerHash[(nbLayer - 1) * MD5_DIGEST_STRING_LENGTH]);
    }
    return 0;
}
