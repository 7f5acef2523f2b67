/* cow.c: a copy-on-write snapshot of memory ranges, for asynchronous checkpoints (issue 15).
 *
 * An asynchronous checkpoint must write the values the arrays had at the call while the
 * application goes on writing them. Copying everything first doubles the memory and blocks the
 * application for a memcpy of the whole state; here the pages are write-protected instead
 * (userfaultfd, synchronous write-protect mode), which blocks it for a page-table walk only:
 *
 *  - the first write to a protected page, by any thread or by the kernel itself (read(2) into
 *    the array: hence no UFFD_USER_MODE_ONLY), stops the writer; a handler thread (cow_pages.c)
 *    copies the page aside and lifts the protection, which wakes the writer; in fact a run of
 *    pages around it, which grows while the faults sweep on (cow_pages.c: one fault per 2 MiB);
 *  - the background reader (cow_copy_out) takes each page from its side copy if there is one,
 *    else from memory (still protected, so unchanged), then lifts the protection of the pages it
 *    has read in full: later writes to them cost nothing.
 *
 * So the extra memory is the pages written before the reader got to them, plus the pages a run
 * copied ahead that no sweep went on past: at most 32 MiB of those (AHEAD_MAX_BYTES). The handler thread
 * never touches Python (the faulting thread may hold the GIL), and everything it writes lives in
 * memory mmap'ed here: a small array's page in the malloc heap may be protected, and a handler
 * writing to it would wait for itself.
 *
 * This file sets a snapshot up (one mmap'ed block of state, the userfaultfd context, the handler
 * thread, the registrations) and tears it down; cow_pages.c keeps the per-page states.
 */
#include <stdio.h>
#include <stdlib.h>
#include "cow_impl.h"

#ifdef __linux__

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
    s->run_min = RUN_MIN_BYTES > page ? RUN_MIN_BYTES / page : 1;
    s->run_max = RUN_MAX_BYTES > page ? RUN_MAX_BYTES / page : 1;
    s->ahead_max = AHEAD_MAX_BYTES / page;
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
        a->first = (size_t)cow_page_index(s, a->page0);
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
        err = pthread_create(&s->thread, NULL, cow_handler, s);
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
        if (cow_write_protect(s, r->addr, r->npages * page, 1) != 0)
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
            cow_write_protect(s, range.start, range.len, 0);  /* wakes the writers waiting */
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

#else /* not Linux: no userfaultfd */

int
cow_create(const uintptr_t *addrs, const size_t *sizes, size_t n, cow_snap **out, char *why, size_t why_len)
{
    snprintf(why, why_len, "copy-on-write snapshots need Linux's userfaultfd");
    return ENOSYS;
}
void cow_release(cow_snap *s) {}
void cow_free(cow_snap *s) {}

#endif
