/* fti_stub.h -- ours (ftidask), not FTI's: the few FTI types, macros and helpers that FTI's dCP-POSIX writer
 * (FTI_InitDCPPosix, FTI_WritePosixDCPData, FTI_PosixDCPClose of src/IO/posix-dcp.c, compiled out of this
 * repository) uses, reduced to the fields it touches, with the constants FTI defines for them
 * (src/IO/posix-dcp.h: MAX_BLOCK_IDX, MAX_VAR_ID; src/interface.h: blockMetaInfo_t). */
#ifndef FTI_STUB_H
#define FTI_STUB_H
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <openssl/md5.h>

#define FTI_BUFS 256
#define FTI_SCES 0
#define FTI_NSCS (-1)
#define FTI_DBUG 1
#define FTI_WARN 3
#define FTI_EROR 4
#define MD5_DIGEST_STRING_LENGTH 33
#define MAX_STACK_SIZE 10
#define MAX_BLOCK_IDX 0x3fffffff
#define MAX_VAR_ID 0x3ffff

/* FTI's src/interface.h: the 6 bytes written before each block of a layer > 0 are this struct's first 6 */
typedef struct blockMetaInfo_t {
    unsigned long varId : 18;
    unsigned long blockId : 30;
} blockMetaInfo_t;

typedef struct { uint32_t hashDataSize; unsigned char *currentHashArray; unsigned char *oldHashArray; } dcpDataPosix_t;
typedef struct FTIT_dataset {
    int id; void *ptr; void *devicePtr; bool isDevicePtr; size_t size; dcpDataPosix_t dcpInfoPosix;
} FTIT_dataset;
typedef struct FTIT_keymap { FTIT_dataset *items; int (*data)(FTIT_dataset **out, int n); } FTIT_keymap;

typedef struct {
    unsigned int digestWidth; unsigned char *(*hashFunc)(const unsigned char *, unsigned long, unsigned char *);
    uint32_t BlockSize; unsigned int StackSize; int cachedCkpt;
} dcpConfPosix_t;
typedef struct FTIT_configuration { dcpConfPosix_t dcpInfoPosix; int cHostBufSize; } FTIT_configuration;
typedef struct {
    unsigned int Counter; unsigned long FileSize; unsigned long dcpSize; unsigned long dataSize;
    unsigned long LayerSize[MAX_STACK_SIZE]; char LayerHash[MAX_STACK_SIZE * MD5_DIGEST_STRING_LENGTH];
} dcpExecPosix_t;
typedef struct { char ckptFile[FTI_BUFS]; } ckptMeta_t;
typedef struct FTIT_execution { int ckptId; int nbVar; dcpExecPosix_t dcpInfoPosix; ckptMeta_t ckptMeta; } FTIT_execution;
typedef struct FTIT_topology { int myRank; } FTIT_topology;
typedef struct FTIT_checkpoint { char dcpDir[FTI_BUFS]; int isInline; } FTIT_checkpoint;

/* FTI's src/IO/posix.h: the POSIX writer's state (file, open flag, running MD5) */
typedef struct { FILE *f; char flag; MD5_CTX integrity; } WritePosixInfo_t;
typedef struct {
    WritePosixInfo_t write_info; FTIT_execution *FTI_Exec; FTIT_configuration *FTI_Conf;
    FTIT_checkpoint *FTI_Ckpt; FTIT_topology *FTI_Topo; size_t layerSize;
} WriteDCPPosixInfo_t;

typedef struct { size_t fetchSize, totalBytesToFetch; bool isDevice; void *dptr; size_t done; } FTIT_data_prefetch;

/* FTI's error-handling fwrite (src/util/macros.h): write, and return ERR from the caller on failure */
#define DFTI_EH_FWRITE(ERR, RES, PTR, SZ, N, F, FMT, BUF) \
    do { RES = fwrite(PTR, SZ, N, F); if (RES != (N)) { perror("fwrite"); return ERR; } } while (0)

void FTI_Print(char *msg, int priority);
int FTI_Try(int result, char *message);
int FTI_PosixOpen(char *fn, WritePosixInfo_t *info);
int FTI_PosixSync(WritePosixInfo_t *info);
int FTI_PosixClose(WritePosixInfo_t *info);
int FTI_CLOSE_ASYNC(FILE *f);
int FTI_InitPrefetcher(FTIT_data_prefetch *p);
int FTI_getPrefetchedData(FTIT_data_prefetch *p, size_t *size, unsigned char **ptr);
int FTI_MD5CPU(FTIT_configuration *conf, FTIT_execution *exec, FTIT_dataset *data);
int FTI_MD5GPU(FTIT_dataset *data);
int FTI_startMD5(void);
int FTI_SyncMD5(void);
char *FTI_GetHashHexStr(unsigned char *hash, int digestWidth, char *hashHexStr);

/* the writer's three entry points (FTI's, compiled from its source) */
void *FTI_InitDCPPosix(FTIT_configuration *, FTIT_execution *, FTIT_topology *, FTIT_checkpoint *, FTIT_keymap *);
int FTI_WritePosixDCPData(FTIT_dataset *data, void *fd);
int FTI_PosixDCPClose(void *fileDesc);
#endif
