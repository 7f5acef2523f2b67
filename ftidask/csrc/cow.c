/* cow.c: a copy-on-write snapshot of memory ranges, for asynchronous checkpoints (issue 15).
 *
 * An asynchronous checkpoint must write the values the arrays had at the call while the
 * application goes on writing them. Copying everything first doubles the memory and blocks the
 * application for a memcpy of the whole state; here the pages are write-protected instead
 * (userfaultfd, synchronous write-protect mode), which blocks it for a page-table walk only:
 *
 *  - the first write to a protected page, by any thread or by the kernel itself (read(2) into
 *    the array: hence no UFFD_USER_MODE_ONLY), stops the writer; the handler thread of this file
 *    copies the page aside and lifts the protection, which wakes the writer;
 *  - the background reader (cow_copy_out) takes each page from its side copy if there is one,
 *    else from memory (still protected, so unchanged), then lifts the protection of the pages it
 *    has read in full: later writes to them cost nothing.
 *
 * So the extra memory is the pages written before the reader got to them. The handler thread
 * never touches Python (the faulting thread may hold the GIL), and everything it writes lives in
 * memory mmap'ed here: a small array's page in the malloc heap may be protected, and a handler
 * writing to it would wait for itself. Per-page state, under the lock of the page's chunk:
 * PROTECTED (unchanged, still protected), COPIED (side copy holds the snapshot), DONE (read out,
 * unprotected), LOST (written, but no memory for its side copy: its copy-out fails).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include "cow.h"

#ifdef __linux__
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <linux/userfaultfd.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Newer than some build hosts' headers; the kernel says at run time what it has. */
#ifndef UFFD_FEATURE_WP_UNPOPULATED
#define UFFD_FEATURE_WP_UNPOPULATED (1 << 13)
#endif
#ifndef USERFAULTFD_IOC_NEW
#define USERFAULTFD_IOC_NEW _IO(0xAA, 0x00)
#endif
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

enum { PROTECTED = 0, COPIED = 1, DONE = 2, LOST = 3 };
#define CHUNK_PAGES 256  /* pages per lock: the reader holds one while copying up to 1 MiB */
#define SLAB_BYTES (2u << 20)

typedef struct { uintptr_t addr; size_t npages, first; } cow_range;          /* one registration */
typedef struct { uintptr_t addr, page0; size_t nbytes, npages, first, cnt; } cow_array;

struct cow_snap {
    size_t map_bytes, page, npages, nranges, narrays, nlocks;
    int uffd, evfd, thread_started, released, populated;
    pid_t pid;
    pthread_t thread;
    pthread_rwlock_t gate;      /* copy-outs (read) against release (write) */
    pthread_mutex_t alloc_lock; /* side pages: free list, slabs and counters */
    void *free_list;
    char *bump;
    size_t bump_left, nslabs, slab_cap, live, peak, copied, lost;
    cow_range *ranges;
    cow_array *arrays;
    uint8_t *state;
    void **side;
    uint32_t *remaining; /* per page: array bytes in it not yet read out (an array's share counts once read in full) */
    uint32_t *cnt;       /* per page of each array: that array's bytes of it read out so far */
    pthread_mutex_t *locks;
    void **slabs;
};

static size_t
align64(size_t n)
{
    return (n + 63) & ~(size_t)63;
}

static int
set_error(char *why, size_t why_len, int err, const char *what)
{
    snprintf(why, why_len, "%s: %s", what, strerror(err));
    return err;
}

/* A context that also sees the kernel's own writes (copy_to_user): never UFFD_USER_MODE_ONLY. Where
 * the syscall is refused (vm.unprivileged_userfaultfd=0 without CAP_SYS_PTRACE), /dev/userfaultfd
 * hands out the same kind of context to whoever may open it. */
static int
open_uffd(char *why, size_t why_len, int *err)
{
    int fd = -1;
#ifdef SYS_userfaultfd
    fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    if (fd >= 0)
        return fd;
    *err = errno;
#else
    *err = ENOSYS;
#endif
    int dev = open("/dev/userfaultfd", O_RDWR | O_CLOEXEC);
    if (dev >= 0) {
        fd = ioctl(dev, USERFAULTFD_IOC_NEW, O_CLOEXEC | O_NONBLOCK);
        int e = errno;
        close(dev);
        if (fd >= 0)
            return fd;
        errno = e;
    }
    if (*err == EPERM)
        snprintf(why, why_len, "userfaultfd for kernel-mode faults is not permitted (needs CAP_SYS_PTRACE, "
                 "vm.unprivileged_userfaultfd=1 or access to /dev/userfaultfd)");
    else
        set_error(why, why_len, *err, "userfaultfd");
    return -1;
}

/* UFFDIO_API may be called once per context: asking for WP_UNPOPULATED on a kernel without it
 * fails, and the plain handshake needs a new context. */
static int
handshake(cow_snap *s, char *why, size_t why_len)
{
    int err = 0;
    for (int attempt = 0; attempt < 2; attempt++) {
        s->uffd = open_uffd(why, why_len, &err);
        if (s->uffd < 0)
            return err;
        struct uffdio_api api = {.api = UFFD_API, .features = attempt == 0 ? UFFD_FEATURE_WP_UNPOPULATED : 0};
        if (ioctl(s->uffd, UFFDIO_API, &api) == 0) {
            if (!(api.features & UFFD_FEATURE_PAGEFAULT_FLAG_WP))
                return set_error(why, why_len, EOPNOTSUPP, "userfaultfd write-protection");
            s->populated = attempt == 0; /* never-touched pages are protected by the kernel's markers */
            return 0;
        }
        err = errno;
        close(s->uffd);
        s->uffd = -1;
        if (err != EINVAL)
            break;
    }
    return set_error(why, why_len, err, "UFFDIO_API");
}

static int
write_protect(cow_snap *s, uintptr_t start, size_t len, int on)
{
    struct uffdio_writeprotect wp = {.range = {.start = start, .len = len}, .mode = on ? UFFDIO_WRITEPROTECT_MODE_WP : 0};
    for (;;) {  /* EAGAIN: the address space is changing (mremap, fork); the call can be repeated */
        if (ioctl(s->uffd, UFFDIO_WRITEPROTECT, &wp) == 0)
            return 0;
        if (errno != EAGAIN && errno != EINTR)
            return -1;
    }
}

/* The global index of the page at addr, or -1 when it is in none of the ranges. */
static long
page_index(cow_snap *s, uintptr_t addr)
{
    size_t lo = 0, hi = s->nranges;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        cow_range *r = &s->ranges[mid];
        if (addr < r->addr)
            hi = mid;
        else if (addr >= r->addr + r->npages * s->page)
            lo = mid + 1;
        else
            return (long)(r->first + (addr - r->addr) / s->page);
    }
    return -1;
}

/* A side page: never malloc, which may write to protected heap pages (see the top). */
static void *
side_alloc(cow_snap *s)
{
    void *p = NULL;
    pthread_mutex_lock(&s->alloc_lock);
    if (s->free_list) {
        p = s->free_list;
        s->free_list = *(void **)p;
    } else {
        if (s->bump_left == 0 && s->nslabs < s->slab_cap) {
            size_t want = s->npages * s->page < SLAB_BYTES ? s->npages * s->page : SLAB_BYTES;
            void *slab = mmap(NULL, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (slab != MAP_FAILED) {
                s->slabs[s->nslabs++] = slab;
                s->bump = slab;
                s->bump_left = want / s->page;
            }
        }
        if (s->bump_left) {
            p = s->bump;
            s->bump += s->page;
            s->bump_left--;
        }
    }
    if (p) {
        s->copied++;
        if (++s->live > s->peak)
            s->peak = s->live;
    } else {
        s->lost++;
    }
    pthread_mutex_unlock(&s->alloc_lock);
    return p;
}

static void
side_free(cow_snap *s, void *p)
{
    pthread_mutex_lock(&s->alloc_lock);
    *(void **)p = s->free_list;
    s->free_list = p;
    s->live--;
    pthread_mutex_unlock(&s->alloc_lock);
}

/* A write fault on a protected page: keep its snapshot value if nobody has yet, then let the
 * writer go. A fault on a page read out meanwhile (DONE) only needs the wake. */
static void
on_fault(cow_snap *s, uintptr_t addr)
{
    addr &= ~(uintptr_t)(s->page - 1);
    long g = page_index(s, addr);
    if (g >= 0) {
        pthread_mutex_t *lock = &s->locks[(size_t)g / CHUNK_PAGES];
        pthread_mutex_lock(lock);
        if (s->state[g] == PROTECTED) {
            void *copy = side_alloc(s);
            if (copy) {
                memcpy(copy, (const void *)addr, s->page);
                s->side[g] = copy;
                s->state[g] = COPIED;
            } else {
                s->state[g] = LOST; /* never block the application: the snapshot fails instead */
            }
        }
        pthread_mutex_unlock(lock);
    }
    /* A failure here leaves the writer blocked until release() unregisters the range; nothing
     * better can be done from this thread. */
    write_protect(s, addr, s->page, 0);
}

static void *
handler(void *arg)
{
    cow_snap *s = arg;
    struct uffd_msg msgs[32];
    struct pollfd fds[2] = {{.fd = s->uffd, .events = POLLIN}, {.fd = s->evfd, .events = POLLIN}};
    for (;;) {
        if (poll(fds, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (fds[1].revents)
            break;
        ssize_t n = read(s->uffd, msgs, sizeof msgs);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR)
                continue;
            break;
        }
        for (size_t i = 0; i < (size_t)n / sizeof msgs[0]; i++)
            if (msgs[i].event == UFFD_EVENT_PAGEFAULT)
                on_fault(s, (uintptr_t)msgs[i].arg.pagefault.address);
    }
    return NULL;
}

static int
cmp_range(const void *a, const void *b)
{
    uintptr_t x = ((const cow_range *)a)->addr, y = ((const cow_range *)b)->addr;
    return x < y ? -1 : x > y;
}

/* Lay out everything in one mmap'ed block (see the top for why not malloc). */
static cow_snap *
layout(const uintptr_t *addrs, const size_t *sizes, size_t n, size_t page)
{
    size_t npages = 0;
    for (size_t i = 0; i < n; i++)
        if (sizes[i])
            npages += ((addrs[i] + sizes[i] + page - 1) / page) - addrs[i] / page;
    size_t nlocks = npages / CHUNK_PAGES + 1, nslabs = npages * page / SLAB_BYTES + 2;
    size_t off[9], total = 0;
    size_t parts[9] = {sizeof(cow_snap), n * sizeof(cow_range), n * sizeof(cow_array), npages, npages * sizeof(void *),
                       npages * sizeof(uint32_t), npages * sizeof(uint32_t), nlocks * sizeof(pthread_mutex_t),
                       nslabs * sizeof(void *)};
    for (int i = 0; i < 9; i++) {
        off[i] = total;
        total += align64(parts[i]);
    }
    char *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED)
        return NULL;
    cow_snap *s = (cow_snap *)base;
    s->map_bytes = total;
    s->page = page;
    s->npages = npages;
    s->nlocks = nlocks;
    s->ranges = (cow_range *)(base + off[1]);
    s->arrays = (cow_array *)(base + off[2]);
    s->state = (uint8_t *)(base + off[3]);
    s->side = (void **)(base + off[4]);
    s->remaining = (uint32_t *)(base + off[5]);
    s->cnt = (uint32_t *)(base + off[6]);
    s->locks = (pthread_mutex_t *)(base + off[7]);
    s->slabs = (void **)(base + off[8]);
    s->slab_cap = nslabs;
    s->uffd = s->evfd = -1;
    s->pid = getpid();
    s->narrays = n;
    /* Page-aligned spans of the arrays, merged where they overlap or touch: one registration each. */
    size_t nr = 0;
    for (size_t i = 0; i < n; i++)
        if (sizes[i]) {
            s->ranges[nr].addr = addrs[i] / page * page;
            s->ranges[nr].npages = (addrs[i] + sizes[i] + page - 1) / page - addrs[i] / page;
            nr++;
        }
    qsort(s->ranges, nr, sizeof(cow_range), cmp_range);
    size_t m = 0;
    for (size_t i = 0; i < nr; i++) {
        cow_range *r = &s->ranges[i];
        if (m && r->addr <= s->ranges[m - 1].addr + s->ranges[m - 1].npages * page) {
            cow_range *last = &s->ranges[m - 1];
            uintptr_t end = r->addr + r->npages * page, last_end = last->addr + last->npages * page;
            if (end > last_end)
                last->npages = (end - last->addr) / page;
        } else {
            s->ranges[m++] = *r;
        }
    }
    s->nranges = m;
    size_t first = 0;
    for (size_t i = 0; i < m; i++) {
        s->ranges[i].first = first;
        first += s->ranges[i].npages;
    }
    s->npages = first; /* merged: at most the sum above */
    size_t cnt = 0;
    for (size_t i = 0; i < n; i++) {
        cow_array *a = &s->arrays[i];
        a->addr = addrs[i];
        a->nbytes = sizes[i];
        if (!sizes[i])
            continue;
        a->page0 = addrs[i] / page * page;
        a->npages = (addrs[i] + sizes[i] + page - 1) / page - addrs[i] / page;
        a->first = (size_t)page_index(s, a->page0);
        a->cnt = cnt;
        cnt += a->npages;
        for (size_t p = 0; p < a->npages; p++) {
            uintptr_t lo = a->page0 + p * page, hi = lo + page;
            lo = lo > a->addr ? lo : a->addr;
            hi = hi < a->addr + a->nbytes ? hi : a->addr + a->nbytes;
            s->remaining[a->first + p] += (uint32_t)(hi - lo);
        }
    }
    return s;
}

/* 1 when [lo, hi) lies entirely in private anonymous mappings. The kernel also registers shared
 * memory (shmem) for write-protection, but a shared page can be written through another mapping
 * or process, which this protection would not see; a private file mapping's unwritten pages are
 * the file's, which others may write. */
static int
anonymous_private(uintptr_t lo, uintptr_t hi)
{
    FILE *maps = fopen("/proc/self/maps", "re");
    if (!maps)
        return 0;
    char line[512];
    uintptr_t covered = lo;
    int ok = 0;
    while (!ok && fgets(line, sizeof line, maps)) {
        unsigned long start, end, offset, inode;
        unsigned major, minor;
        char perms[8];
        int path_at = 0;
        if (sscanf(line, "%lx-%lx %7s %lx %x:%x %lu %n", &start, &end, perms, &offset, &major, &minor, &inode,
                   &path_at) < 7)
            break;
        if (end <= covered || start >= hi)
            continue;
        const char *path = line + path_at;
        int anonymous = inode == 0 && major == 0 && minor == 0 &&
                        (*path == '\n' || *path == '\0' || !strncmp(path, "[heap]", 6) || !strncmp(path, "[anon:", 6));
        if (start > covered || !anonymous || perms[0] != 'r' || perms[1] != 'w' || perms[3] != 'p')
            break;
        covered = end;
        ok = covered >= hi;
    }
    fclose(maps);
    return ok;
}

int
cow_create(const uintptr_t *addrs, const size_t *sizes, size_t n, cow_snap **out, char *why, size_t why_len)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    cow_snap *s = layout(addrs, sizes, n, page);
    if (!s)
        return set_error(why, why_len, errno, "mmap");
    pthread_rwlock_init(&s->gate, NULL);
    pthread_mutex_init(&s->alloc_lock, NULL);
    for (size_t i = 0; i < s->nlocks; i++)
        pthread_mutex_init(&s->locks[i], NULL);
    int err = handshake(s, why, why_len);
    if (!err) {
        s->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (s->evfd < 0)
            err = set_error(why, why_len, errno, "eventfd");
    }
    if (!err) {
        /* Started before anything is protected (its start may touch the heap), with every signal
         * blocked: a signal handler running on it could write to protected memory. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        err = pthread_create(&s->thread, NULL, handler, s);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (err)
            set_error(why, why_len, err, "pthread_create");
        else
            s->thread_started = 1;
    }
    for (size_t i = 0; !err && i < s->nranges; i++)
        if (!anonymous_private(s->ranges[i].addr, s->ranges[i].addr + s->ranges[i].npages * page))
            err = set_error(why, why_len, EINVAL, "memory that is not private anonymous (shared or file-backed)");
    size_t registered = 0;
    for (; !err && registered < s->nranges; registered++) {
        cow_range *r = &s->ranges[registered];
        struct uffdio_register reg = {.range = {.start = r->addr, .len = r->npages * page}, .mode = UFFDIO_REGISTER_MODE_WP};
        if (ioctl(s->uffd, UFFDIO_REGISTER, &reg) != 0) {
            err = errno;
            snprintf(why, why_len, "cannot register %#lx+%zu: %s%s", (unsigned long)r->addr, r->npages * page,
                     strerror(err), err == EBUSY ? " (registered with another userfaultfd)"
                     : err == EINVAL ? " (not private anonymous memory?)" : "");
            break;
        }
        if (!(reg.ioctls & ((uint64_t)1 << _UFFDIO_WRITEPROTECT))) {
            registered++;
            err = set_error(why, why_len, EOPNOTSUPP, "UFFDIO_WRITEPROTECT on this memory");
            break;
        }
    }
    for (size_t i = 0; !err && i < s->nranges; i++) {
        cow_range *r = &s->ranges[i];
        /* Without WP_UNPOPULATED a never-touched page has nothing to protect and its first write
         * would not fault: map the zero page there first (reads cost no memory). */
        if (!s->populated && madvise((void *)r->addr, r->npages * page, MADV_POPULATE_READ) != 0)
            for (size_t p = 0; p < r->npages; p++)
                (void)*(volatile const char *)(r->addr + p * page);
        if (write_protect(s, r->addr, r->npages * page, 1) != 0)
            err = set_error(why, why_len, errno, "UFFDIO_WRITEPROTECT");
    }
    if (err) {
        s->nranges = registered; /* release() unprotects and unregisters those only */
        cow_release(s);
        cow_free(s);
        return err;
    }
    *out = s;
    return 0;
}

/* Copy bytes [addr, addr + len) of global page g, of array j, to dst and count them read out;
 * under the page's chunk lock. 1 when the page became DONE (to unprotect), 0, or -errno. */
static int
take(cow_snap *s, cow_array *a, size_t g, uintptr_t addr, size_t len, char *dst)
{
    uintptr_t page_addr = addr & ~(uintptr_t)(s->page - 1);
    uint8_t st = s->state[g];
    if (st == DONE)
        return -EALREADY;  /* read out in full before (and maybe written since): refuse, never guess */
    if (st == LOST)
        return -ENOMEM;
    memcpy(dst, st == COPIED ? (const char *)s->side[g] + (addr - page_addr) : (const char *)addr, len);
    size_t p = (page_addr - a->page0) / s->page;
    uintptr_t lo = page_addr > a->addr ? page_addr : a->addr;
    uintptr_t hi = page_addr + s->page < a->addr + a->nbytes ? page_addr + s->page : a->addr + a->nbytes;
    uint32_t full = (uint32_t)(hi - lo), before = s->cnt[a->cnt + p];
    s->cnt[a->cnt + p] = before + (uint32_t)len;
    if (before >= full || before + len < full)
        return 0;
    s->remaining[g] -= full;
    if (s->remaining[g])
        return 0;
    if (st == COPIED) {
        side_free(s, s->side[g]);
        s->side[g] = NULL;
    }
    s->state[g] = DONE;
    return 1;
}

static int
overlaps_ranges(cow_snap *s, uintptr_t lo, uintptr_t hi)
{
    for (size_t i = 0; i < s->nranges; i++)
        if (lo < s->ranges[i].addr + s->ranges[i].npages * s->page && s->ranges[i].addr < hi)
            return 1;
    return 0;
}

int
cow_copy_out(cow_snap *s, size_t j, size_t start, char *out, size_t n)
{
    pthread_rwlock_rdlock(&s->gate);
    if (s->released || getpid() != s->pid) {
        pthread_rwlock_unlock(&s->gate);
        return EBADF;
    }
    if (j >= s->narrays || start > s->arrays[j].nbytes || n > s->arrays[j].nbytes - start) {
        pthread_rwlock_unlock(&s->gate);
        return ERANGE;
    }
    cow_array *a = &s->arrays[j];
    /* An output in protected pages (a small buffer in the heap next to a small array) faults when
     * written: its handler needs the chunk lock, so then each page goes through a bounce buffer
     * written with no lock held. Allocated before any lock, and outside the protected pages. */
    char *bounce = NULL;
    if (n && overlaps_ranges(s, (uintptr_t)out, (uintptr_t)out + n)) {
        bounce = mmap(NULL, s->page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (bounce == MAP_FAILED) {
            pthread_rwlock_unlock(&s->gate);
            return ENOMEM;
        }
    }
    int err = 0;
    uintptr_t addr = a->addr + start, end = addr + n;
    uintptr_t run_lo = 0, run_hi = 0; /* pages that became DONE, unprotected in one call */
    long held = -1;
    while (addr < end && !err) {
        uintptr_t page_addr = addr & ~(uintptr_t)(s->page - 1);
        size_t len = (page_addr + s->page < end ? page_addr + s->page : end) - addr;
        size_t g = a->first + (page_addr - a->page0) / s->page;
        long chunk = (long)(g / CHUNK_PAGES);
        if (chunk != held) {
            if (held >= 0)
                pthread_mutex_unlock(&s->locks[held]);
            if (run_hi > run_lo && write_protect(s, run_lo, run_hi - run_lo, 0) != 0)
                err = errno; /* the lock is not held across the ioctl */
            run_lo = run_hi = 0;
            held = -1;
            if (err)
                break;
            pthread_mutex_lock(&s->locks[chunk]);
            held = chunk;
        }
        int rc = take(s, a, g, addr, len, bounce ? bounce : out);
        if (bounce) {
            pthread_mutex_unlock(&s->locks[held]);
            held = -1;
            if (rc >= 0)
                memcpy(out, bounce, len);
        }
        if (rc < 0) {
            err = -rc;
        } else if (rc == 1) {
            if (run_hi != page_addr) {
                if (run_hi > run_lo && write_protect(s, run_lo, run_hi - run_lo, 0) != 0)
                    err = errno;
                run_lo = page_addr;
            }
            run_hi = page_addr + s->page;
        }
        out += len;
        addr += len;
    }
    if (held >= 0)
        pthread_mutex_unlock(&s->locks[held]);
    if (!err && run_hi > run_lo && write_protect(s, run_lo, run_hi - run_lo, 0) != 0)
        err = errno;
    if (bounce)
        munmap(bounce, s->page);
    pthread_rwlock_unlock(&s->gate);
    return err;
}

void
cow_release(cow_snap *s)
{
    int child = getpid() != s->pid;
    /* In a forked child the locks may be held by threads that do not exist there, and the ioctls
     * would act on the parent's memory (the context belongs to the parent's address space). */
    if (!child)
        pthread_rwlock_wrlock(&s->gate); /* waits for the copy-outs in flight */
    if (!s->released) {
        s->released = 1;
        for (size_t i = 0; !child && i < s->nranges; i++) {
            cow_range *r = &s->ranges[i];
            struct uffdio_range range = {.start = r->addr, .len = r->npages * s->page};
            write_protect(s, range.start, range.len, 0);  /* wakes the writers waiting */
            ioctl(s->uffd, UFFDIO_UNREGISTER, &range);
        }
        if (s->thread_started && !child) {
            uint64_t one = 1;
            while (write(s->evfd, &one, sizeof one) < 0 && errno == EINTR)
                ;
            pthread_join(s->thread, NULL);
        }
        s->thread_started = 0;
        if (s->evfd >= 0)
            close(s->evfd);
        if (s->uffd >= 0)
            close(s->uffd); /* also drops whatever is still registered, and wakes its waiters */
        s->evfd = s->uffd = -1;
        for (size_t i = 0; i < s->nslabs; i++)
            munmap(s->slabs[i], s->npages * s->page < SLAB_BYTES ? s->npages * s->page : SLAB_BYTES);
        s->nslabs = 0;
        s->free_list = NULL;
        s->bump_left = 0;
        s->live = 0;
    }
    if (!child)
        pthread_rwlock_unlock(&s->gate);
}

void
cow_free(cow_snap *s)
{
    munmap(s, s->map_bytes);
}

void
cow_stats(cow_snap *s, cow_stat *st)
{
    pthread_mutex_lock(&s->alloc_lock);
    st->pages_copied = s->copied;
    st->pages_lost = s->lost;
    st->peak_bytes = s->peak * s->page;
    st->live_bytes = s->live * s->page;
    st->pages = s->npages;
    st->ranges = s->nranges;
    st->unpopulated_protected = s->populated;
    pthread_mutex_unlock(&s->alloc_lock);
}

#else /* not Linux: no userfaultfd */

int
cow_create(const uintptr_t *addrs, const size_t *sizes, size_t n, cow_snap **out, char *why, size_t why_len)
{
    snprintf(why, why_len, "copy-on-write snapshots need Linux's userfaultfd");
    return ENOSYS;
}
int cow_copy_out(cow_snap *s, size_t j, size_t start, char *out, size_t n) { return ENOSYS; }
void cow_release(cow_snap *s) {}
void cow_free(cow_snap *s) {}
void cow_stats(cow_snap *s, cow_stat *st) { memset(st, 0, sizeof *st); }

#endif

/* The Python entry points: a snapshot is a capsule, released by its destructor at the latest. */
#define CAPSULE "ftidask._native.cow"

static void
capsule_free(PyObject *capsule)
{
    cow_snap *s = PyCapsule_GetPointer(capsule, CAPSULE);
    if (s) {  /* nothing else holds the capsule, so no copy-out is in flight */
        cow_release(s);
        cow_free(s);
    }
}

static cow_snap *
from_capsule(PyObject *capsule)
{
    return PyCapsule_GetPointer(capsule, CAPSULE);
}

const char cow_new_doc[] =
    "cow_new(regions)\n--\n\n"
    "Write-protect the pages of every (address, nbytes) region and keep their present values\n"
    "until read out: a snapshot handle. The memory must stay mapped until cow_release.\n"
    "OSError(errno, why) when this process, kernel or memory does not allow it.";

PyObject *
cow_new_py(PyObject *module, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "regions must be a sequence of (address, nbytes)");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uintptr_t *addrs = PyMem_Calloc((size_t)n + 1, sizeof(uintptr_t));
    size_t *sizes = PyMem_Calloc((size_t)n + 1, sizeof(size_t));
    PyObject *result = NULL;
    if (!addrs || !sizes) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long addr;
        Py_ssize_t size;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "Kn:cow_new", &addr, &size))
            goto done;
        if (size < 0) {
            PyErr_SetString(PyExc_ValueError, "nbytes must not be negative");
            goto done;
        }
        addrs[i] = (uintptr_t)addr;
        sizes[i] = (size_t)size;
    }
    cow_snap *s = NULL;
    char why[256] = "";
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = cow_create(addrs, sizes, (size_t)n, &s, why, sizeof why);
    Py_END_ALLOW_THREADS
    if (err) {
        PyObject *exc = Py_BuildValue("(is)", err, why);
        if (exc) {
            PyErr_SetObject(PyExc_OSError, exc);
            Py_DECREF(exc);
        }
        goto done;
    }
    result = PyCapsule_New(s, CAPSULE, capsule_free);
    if (!result) {
        cow_release(s);
        cow_free(s);
    }
done:
    PyMem_Free(addrs);
    PyMem_Free(sizes);
    Py_DECREF(seq);
    return result;
}

const char cow_copy_doc[] =
    "cow_copy(snapshot, index, start, out)\n--\n\n"
    "Copy bytes [start, start + len(out)) of region index, as they were at cow_new, into the\n"
    "writable buffer out; the pages read out in full are unprotected. Without the GIL. Each byte\n"
    "is read out once: a page read out in full before raises OSError(EALREADY).";

PyObject *
cow_copy_py(PyObject *module, PyObject *args)
{
    PyObject *capsule;
    Py_ssize_t index, start;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "Onnw*:cow_copy", &capsule, &index, &start, &out))
        return NULL;
    cow_snap *s = from_capsule(capsule);
    int err = 0;
    if (s && (index < 0 || start < 0))
        err = ERANGE;
    else if (s) {
        Py_BEGIN_ALLOW_THREADS
        err = cow_copy_out(s, (size_t)index, (size_t)start, out.buf, (size_t)out.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    if (!s)
        return NULL;
    if (err == ERANGE)
        return PyErr_Format(PyExc_ValueError, "bytes [%zd, %zd) are not in region %zd", start, start + out.len, index);
    if (err) {
        const char *what = err == EBADF ? "snapshot released" : err == EALREADY ? "bytes already read out (their pages are unprotected)"
                           : err == ENOMEM ? "a page was written when no memory was left for its copy" : strerror(err);
        PyObject *exc = Py_BuildValue("(is)", err, what);
        if (exc) {
            PyErr_SetObject(PyExc_OSError, exc);
            Py_DECREF(exc);
        }
        return NULL;
    }
    Py_RETURN_NONE;
}

const char cow_release_doc[] =
    "cow_release(snapshot)\n--\n\n"
    "Unprotect and unregister everything and free the side copies (waits for copy-outs in\n"
    "flight). Idempotent.";

PyObject *
cow_release_py(PyObject *module, PyObject *arg)
{
    cow_snap *s = from_capsule(arg);
    if (!s)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    cow_release(s);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

const char cow_stats_doc[] =
    "cow_stats(snapshot)\n--\n\n"
    "A dict: pages_copied, pages_lost, peak_bytes (of side copies at once), live_bytes, pages,\n"
    "ranges (registrations), unpopulated_protected.";

PyObject *
cow_stats_py(PyObject *module, PyObject *arg)
{
    cow_snap *s = from_capsule(arg);
    if (!s)
        return NULL;
    cow_stat st;
    cow_stats(s, &st);
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n,s:O}", "pages_copied", (Py_ssize_t)st.pages_copied, "pages_lost",
                         (Py_ssize_t)st.pages_lost, "peak_bytes", (Py_ssize_t)st.peak_bytes, "live_bytes",
                         (Py_ssize_t)st.live_bytes, "pages", (Py_ssize_t)st.pages, "ranges", (Py_ssize_t)st.ranges,
                         "unpopulated_protected", st.unpopulated_protected ? Py_True : Py_False);
}

const char cow_probe_doc[] =
    "cow_probe()\n--\n\n"
    "(True, '') when this process can take copy-on-write snapshots, else (False, why): one page\n"
    "of fresh memory is protected and released.";

PyObject *
cow_probe_py(PyObject *module, PyObject *unused)
{
    char why[256] = "";
    int err = ENOSYS;
#ifdef __linux__
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    void *mem = mmap(NULL, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED)
        return Py_BuildValue("(Os)", Py_False, "mmap failed");
    uintptr_t addr = (uintptr_t)mem;
    cow_snap *s = NULL;
    Py_BEGIN_ALLOW_THREADS
    err = cow_create(&addr, &page, 1, &s, why, sizeof why);
    if (!err) {
        cow_release(s);
        cow_free(s);
    }
    Py_END_ALLOW_THREADS
    munmap(mem, page);
#else
    snprintf(why, sizeof why, "copy-on-write snapshots need Linux's userfaultfd");
#endif
    return Py_BuildValue("(Os)", err ? Py_False : Py_True, why);
}
