/* cow_impl.h: the snapshot's state, and the functions the parts of a snapshot call across files,
 * shared by cow.c (set-up, release), cow_layout.c (regions, state block), cow_uffd.c (userfaultfd
 * context), cow_pages.c (page primitives), cow_fault.c (write faults), cow_events.c (handler
 * thread, events), cow_copyout.c (copy-out) and cow_py.c (Python entry points). Linux only. */
#ifndef FTIDASK_COW_IMPL_H
#define FTIDASK_COW_IMPL_H

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include "cow.h"

#ifdef __linux__
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <linux/userfaultfd.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

/* Newer than some build hosts' headers; the kernel says at run time what it has. */
#ifndef UFFD_FEATURE_WP_UNPOPULATED
#define UFFD_FEATURE_WP_UNPOPULATED (1 << 13)
#endif
#ifndef USERFAULTFD_IOC_NEW
#define USERFAULTFD_IOC_NEW _IO(0xAA, 0x00)
#endif
#ifndef UFFD_FEATURE_EVENT_REMOVE
#define UFFD_FEATURE_EVENT_REMOVE (1 << 3)
#endif
#ifndef UFFD_EVENT_REMOVE
#define UFFD_EVENT_REMOVE 0x15
#endif
#ifndef UFFD_FEATURE_EVENT_REMAP
#define UFFD_FEATURE_EVENT_REMAP (1 << 1)
#endif
#ifndef UFFD_FEATURE_EVENT_UNMAP
#define UFFD_FEATURE_EVENT_UNMAP (1 << 6)
#endif
#ifndef UFFD_EVENT_REMAP
#define UFFD_EVENT_REMAP 0x14
#endif
#ifndef UFFD_EVENT_UNMAP
#define UFFD_EVENT_UNMAP 0x16
#endif
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

/* AHEAD: copied aside by the run around another page's fault (COPIED: the faulting page, or a
 * page of a run that a sweep went on past, so written). Both are read from the side copy. */
/* DROPPED: still protected when madvise(DONTNEED/FREE) dropped it (UFFD_EVENT_REMOVE): the
 * snapshot value is gone, like LOST's. GONE: still protected when it was unmapped or moved away
 * (munmap, mremap: a realloc, ndarray.resize(refcheck=False); UFFD_EVENT_UNMAP/REMAP), or found
 * unreadable: gone too, and its address must never be read again (another mapping may be there). */
enum { PROTECTED = 0, COPIED = 1, DONE = 2, LOST = 3, AHEAD = 4, DROPPED = 5, GONE = 6 };
#define CHUNK_PAGES 256  /* pages per lock: the reader holds one while copying up to 1 MiB */
#define SLAB_BYTES (2u << 20)
/* A write fault copies aside and unprotects an aligned run of pages around the faulting one, like
 * readahead: RUN_MIN_BYTES on a fault out of the blue, doubled on each fault that carries on where
 * a run ended (a sweep), up to RUN_MAX_BYTES (a huge page: one PMD, unprotected without a split).
 * So a sweep faults about once per 2 MiB, and a random write copies at most RUN_MIN_BYTES. */
#define RUN_MIN_BYTES (64u << 10)
#define RUN_MAX_BYTES (2u << 20)
#define STREAMS 8  /* sweeps followed at once (handler thread only) */
/* At most this many bytes of AHEAD pages held at once: beyond it a fault copies its own page only,
 * so the extra memory stays within the pages written meanwhile plus this (scattered writes would
 * otherwise hold a whole run per written page). */
#define AHEAD_MAX_BYTES (32u << 20)

typedef struct { uintptr_t lo, hi; size_t pages; unsigned long used; } cow_stream; /* last run of a sweep */
/* A run whose unprotection the kernel refused with EAGAIN while a madvise waited for the handler to
 * read its UFFD_EVENT_REMOVE (mmap_changing): retried after the next read (handler thread only).
 * Beyond DEFER_MAX the writer waits until the reader or release() unprotects its pages. */
typedef struct { uintptr_t lo; size_t len; } cow_defer;
#define DEFER_MAX 1024

typedef struct { uintptr_t addr; size_t npages, first; } cow_range;          /* one registration */
typedef struct { uintptr_t addr, page0; size_t nbytes, npages, first, cnt; } cow_array;

struct cow_snap {
    size_t map_bytes, page, npages, nranges, narrays, nlocks;
    int uffd, evfd, thread_started, released, populated;
    int remove_events;          /* UFFD_FEATURE_EVENT_REMOVE is on */
    int unmap_events;           /* UFFD_FEATURE_EVENT_UNMAP and UFFD_FEATURE_EVENT_REMAP are on */
    /* The live pages are read with process_vm_readv on this process, which fails where the memory
     * is no longer mapped (munmap, mremap) instead of faulting like memcpy (cow.c: probed). */
    int safe_read;
    /* Odd while the handler may have let a madvise drop pages, or an munmap/mremap go on after
     * unmapping pages, that it has not yet marked DROPPED or GONE (from just before its read of the
     * uffd to the end of that batch), bumped again after; a copy-out that read a page from memory
     * trusts it only if this was even and unchanged across its read (cow_copyout.c: take_live). An
     * unmap is reported after the fact, so its pages may be read before their event: safe_read. */
    size_t remove_seq;
    /* Bumped (while remove_seq is odd) by each batch that holds such an event, before it marks
     * anything: a read that saw remove_seq even at both ends and this unchanged overlapped no
     * batch but harmless ones (faults only), which come and go all the time under writers. */
    size_t event_gen;
    cow_defer *deferred;        /* handler thread only */
    size_t ndeferred;
    cow_snap *live_next;        /* the process's live snapshots (cow_out_protected); listed: */
    int listed;
    pid_t pid;
    pthread_t thread;
    pthread_rwlock_t gate;      /* copy-outs (read) against release (write) */
    pthread_mutex_t alloc_lock; /* side pages: free list, slabs and counters */
    void *free_list;
    char *bump;
    size_t bump_left, nslabs, slab_cap, live, peak, copied, lost, ahead; /* ahead: copied by a run, not the faulting page */
    size_t ahead_live, ahead_max; /* AHEAD pages held now, and the most allowed (pages) */
    size_t faults;              /* write faults handled (atomic) */
    size_t run_min, run_max;    /* pages */
    cow_stream streams[STREAMS];
    unsigned long stream_clock;
    cow_range *ranges;
    cow_array *arrays;
    uint8_t *state;
    void **side;
    uint32_t *remaining; /* per page: array bytes in it not yet read out (an array's share counts once read in full) */
    uint32_t *cnt;       /* per page of each array: that array's bytes of it read out so far */
    pthread_mutex_t *locks;
    void **slabs;
};

/* cow.c */
int cow_set_error(char *why, size_t why_len, int err, const char *what);
int cow_out_protected(uintptr_t lo, uintptr_t hi);
/* cow_layout.c */
int cow_check_regions(const uintptr_t *addrs, const size_t *sizes, size_t n, size_t page, char *why, size_t why_len);
cow_snap *cow_layout(const uintptr_t *addrs, const size_t *sizes, size_t n, size_t page);
/* cow_uffd.c */
int cow_handshake(cow_snap *s, char *why, size_t why_len);
int cow_probe_safe_read(void);
/* cow_pages.c */
int cow_write_protect(cow_snap *s, uintptr_t start, size_t len, int on);
size_t cow_read_live(cow_snap *s, const struct iovec *local, const struct iovec *remote, size_t n);
long cow_page_index(cow_snap *s, uintptr_t addr);
cow_range *cow_find_range(cow_snap *s, uintptr_t addr);
void *cow_side_alloc(cow_snap *s, int ahead);
void cow_side_free(cow_snap *s, void *p, int ahead);
/* cow_fault.c */
void cow_on_fault(cow_snap *s, uintptr_t addr);
/* cow_events.c */
void cow_unprotect_run(cow_snap *s, uintptr_t lo, size_t len);
void *cow_handler(void *arg);

#endif
#endif
