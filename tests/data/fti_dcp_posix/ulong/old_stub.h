/* old_stub.h -- ours (ftidask), not FTI's: the FTI types of the time (FTIT_dataset arrays, meta[0]) reduced to the
 * fields FTI_WritePosixDcp of src/diff-checkpoint-posix.c (commit 042fdb56, compiled out of this repository)
 * touches, with FTI's constants and blockMetaInfo_t (src/interface.h of the time). */
#ifndef OLD_STUB_H
#define OLD_STUB_H
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <openssl/md5.h>

#define FTI_BUFS 256
#define FTI_SCES 0
#define FTI_NSCS (-1)
#define FTI_WARN 3
#define FTI_EROR 4
#define MD5_DIGEST_STRING_LENGTH 33
#define MAX_STACK_SIZE 10
#define MAX_BLOCK_IDX 0x3fffffff
#define MAX_VAR_ID 0x3ffff

typedef struct blockMetaInfo_t { unsigned long varId : 18; unsigned long blockId : 30; } blockMetaInfo_t;
typedef struct { unsigned long hashDataSize; unsigned char *hashArray; unsigned char *hashArrayTmp; } dcpDataPosix_t;
typedef struct FTIT_dataset { int id; void *ptr; long size; dcpDataPosix_t dcpInfoPosix; } FTIT_dataset;
typedef struct {
    unsigned int digestWidth; unsigned char *(*hashFunc)(const unsigned char *, unsigned long, unsigned char *);
    unsigned long BlockSize; unsigned int StackSize;
} dcpConfPosix_t;
typedef struct FTIT_configuration { dcpConfPosix_t dcpInfoPosix; } FTIT_configuration;
typedef struct {
    unsigned int Counter; unsigned long FileSize; unsigned long LayerSize[MAX_STACK_SIZE];
    char LayerHash[MAX_STACK_SIZE * MD5_DIGEST_STRING_LENGTH];
} dcpExecPosix_t;
typedef struct { char ckptFile[FTI_BUFS]; } FTIT_metadata;
typedef struct FTIT_execution { int ckptID; int nbVar; dcpExecPosix_t dcpInfoPosix; FTIT_metadata meta[5]; } FTIT_execution;
typedef struct FTIT_topology { int myRank; int splitRank; } FTIT_topology;
typedef struct FTIT_checkpoint { char dcpDir[FTI_BUFS]; int isInline; } FTIT_checkpoint;

void FTI_Print(char *msg, int priority);
char *hashHex(const unsigned char *hash, int digestWidth, char *hashHexStr);
int FTI_WritePosixDcp(FTIT_configuration *, FTIT_execution *, FTIT_topology *, FTIT_checkpoint *, FTIT_dataset *);
#endif
