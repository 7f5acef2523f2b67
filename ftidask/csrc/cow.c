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
 *    has read in full: later writes to them cost nothing;
 *  - memory the application unmaps or moves meanwhile (munmap, mremap: a realloc such as
 *    ndarray.resize(refcheck=False)) is reported to the handler (UFFD_EVENT_UNMAP/REMAP), like
 *    madvise's drops (UFFD_EVENT_REMOVE): its pages' copy-out fails. The report comes after the
 *    unmap, so memory is read with process_vm_readv, which fails there instead of faulting.
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

/* UFFDIO_API may be called once per context: asking for a feature the kernel lacks fails, and the
 * next try needs a new context. So a first context asks for nothing and learns what the kernel has
 * (api.features), the next asks for what is wanted of that. WP_UNPOPULATED protects never-touched
 * pages; EVENT_REMOVE tells the handler of madvise(DONTNEED/FREE) on protected memory, which drops
 * pages without a fault; EVENT_UNMAP and EVENT_REMAP of munmap and mremap (a realloc, an
 * ndarray.resize(refcheck=False)), which take them away (cow_pages.c: their copy-out then fails
 * instead of reading zeros, or memory that is no longer there). */
static int
handshake(cow_snap *s, char *why, size_t why_len)
{
    static const uint64_t events = UFFD_FEATURE_EVENT_REMOVE | UFFD_FEATURE_EVENT_UNMAP | UFFD_FEATURE_EVENT_REMAP;
    uint64_t wanted[] = {0, UFFD_FEATURE_WP_UNPOPULATED | events, events, UFFD_FEATURE_EVENT_REMOVE, 0};
    int err = 0;
    for (size_t attempt = 0; attempt < sizeof wanted / sizeof wanted[0]; attempt++) {
        s->uffd = open_uffd(why, why_len, &err);
        if (s->uffd < 0)
            return err;
        struct uffdio_api api = {.api = UFFD_API, .features = wanted[attempt]};
        if (ioctl(s->uffd, UFFDIO_API, &api) == 0) {
            if (!(api.features & UFFD_FEATURE_PAGEFAULT_FLAG_WP))
                return set_error(why, why_len, EOPNOTSUPP, "userfaultfd write-protection");
            if (attempt == 0) { /* what the kernel has: ask for that of the rest */
                for (size_t i = 1; i < sizeof wanted / sizeof wanted[0]; i++)
                    wanted[i] &= api.features;
                close(s->uffd);
                s->uffd = -1;
                continue;
            }
            /* api.features lists what the kernel has; what was asked for is what is on. With
             * WP_UNPOPULATED, never-touched pages are protected by the kernel's markers. */
            s->populated = (wanted[attempt] & UFFD_FEATURE_WP_UNPOPULATED) != 0;
            s->remove_events = (wanted[attempt] & UFFD_FEATURE_EVENT_REMOVE) != 0;
            s->unmap_events = (wanted[attempt] & (UFFD_FEATURE_EVENT_UNMAP | UFFD_FEATURE_EVENT_REMAP)) ==
                              (UFFD_FEATURE_EVENT_UNMAP | UFFD_FEATURE_EVENT_REMAP);
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

/* Whether process_vm_readv on this process works here (a seccomp filter may refuse it): the live
 * pages are then read with it, which fails on memory unmapped meanwhile where memcpy would fault
 * (an munmap is reported to the handler only after the fact). */
static int
probe_safe_read(void)
{
#ifdef SYS_process_vm_readv
    char from[16] = "ftidask-cow", to[16] = "";
    struct iovec local = {.iov_base = to, .iov_len = sizeof from}, remote = {.iov_base = from, .iov_len = sizeof from};
    long n = syscall(SYS_process_vm_readv, (long)getpid(), &local, 1L, &remote, 1L, 0L);
    return n == (long)sizeof from && !memcmp(from, to, sizeof from);
#else
    return 0;
#endif
}

/* The snapshots of this process from before their first protection until after their last:
 * cow_copy_out writes its output with a chunk lock held only where none of them protects it (see
 * there). A fork in the middle of a change leaves the child the lock released (atfork). */
static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static cow_snap *live_head;
static pthread_once_t live_once = PTHREAD_ONCE_INIT;

static void live_prepare(void) { pthread_mutex_lock(&live_lock); }
static void live_resume(void) { pthread_mutex_unlock(&live_lock); }
static void live_init(void) { pthread_atfork(live_prepare, live_resume, live_resume); }

static void
live_add(cow_snap *s)
{
    pthread_once(&live_once, live_init);
    pthread_mutex_lock(&live_lock);
    s->live_next = live_head;
    live_head = s;
    s->listed = 1;
    pthread_mutex_unlock(&live_lock);
}

static void
live_remove(cow_snap *s)
{
    pthread_mutex_lock(&live_lock);
    for (cow_snap **p = &live_head; *p; p = &(*p)->live_next)
        if (*p == s) {
            *p = s->live_next;
            break;
        }
    s->listed = 0;
    pthread_mutex_unlock(&live_lock);
}

/* 1 when a live snapshot of this process has pages in [lo, hi): a write there may fault into its
 * handler. */
int
cow_out_protected(uintptr_t lo, uintptr_t hi)
{
    int hit = 0;
    pthread_mutex_lock(&live_lock);
    for (cow_snap *s = live_head; s && !hit; s = s->live_next)
        for (size_t i = 0; i < s->nranges && !hit; i++)
            hit = lo < s->ranges[i].addr + s->ranges[i].npages * s->page && s->ranges[i].addr < hi;
    pthread_mutex_unlock(&live_lock);
    return hit;
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
    /* The regions were checked (cow_create: no wrap, mapped), so each count fits; their sum and
     * the sizes below are checked all the same: many regions of the same memory add up. */
    size_t npages = 0, bytes_max = SIZE_MAX / 2;
    for (size_t i = 0; i < n; i++)
        if (sizes[i] && __builtin_add_overflow(npages, ((addrs[i] + sizes[i] + page - 1) / page) - addrs[i] / page,
                                               &npages)) {
            errno = ENOMEM;
            return NULL;
        }
    if (npages > bytes_max / page || n > bytes_max / sizeof(cow_array)) {
        errno = ENOMEM;
        return NULL;
    }
    size_t nlocks = npages / CHUNK_PAGES + 1, nslabs = npages * page / SLAB_BYTES + 2;
    size_t off[10], total = 0;
    size_t parts[10] = {sizeof(cow_snap), n * sizeof(cow_range), n * sizeof(cow_array), npages, npages * sizeof(void *),
                        npages * sizeof(uint32_t), npages * sizeof(uint32_t), nlocks * sizeof(pthread_mutex_t),
                        nslabs * sizeof(void *), DEFER_MAX * sizeof(cow_defer)};
    for (int i = 0; i < 10; i++) {
        off[i] = total;
        if (__builtin_add_overflow(total, align64(parts[i]), &total)) {
            errno = ENOMEM;
            return NULL;
        }
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
    s->deferred = (cow_defer *)(base + off[9]);
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

/* The mappings of /proc/self/maps, in address order, each marked when it is private anonymous
 * memory. The kernel also registers shared memory (shmem) for write-protection, but a shared page
 * can be written through another mapping or process, which this protection would not see; a private
 * file mapping's unwritten pages are the file's, which others may write. Whole lines (getline): a
 * file mapping's path may make one longer than any fixed buffer. malloc is fine here: nothing is
 * protected yet. NULL (errno set) when the file cannot be read. */
typedef struct { uintptr_t start, end; int ok; } cow_map;

static cow_map *
load_maps(size_t *count)
{
    FILE *maps = fopen("/proc/self/maps", "re");
    if (!maps)
        return NULL;
    cow_map *list = NULL;
    size_t n = 0, cap = 0, line_cap = 0;
    char *line = NULL;
    int err = 0;
    while (getline(&line, &line_cap, maps) > 0) {
        unsigned long start, end, offset, inode;
        unsigned major, minor;
        char perms[8];
        int path_at = 0;
        if (sscanf(line, "%lx-%lx %7s %lx %x:%x %lu %n", &start, &end, perms, &offset, &major, &minor, &inode,
                   &path_at) < 7)
            continue; /* not a mapping's line: a gap, so nothing there is taken for anonymous memory */
        const char *path = line + path_at;
        int anonymous = inode == 0 && major == 0 && minor == 0 &&
                        (*path == '\n' || *path == '\0' || !strncmp(path, "[heap]", 6) || !strncmp(path, "[anon:", 6));
        if (n == cap) {
            cow_map *grown = realloc(list, (cap = cap ? 2 * cap : 256) * sizeof(cow_map));
            if (!grown) {
                err = ENOMEM;
                break;
            }
            list = grown;
        }
        list[n].start = start;
        list[n].end = end;
        list[n].ok = anonymous && strlen(perms) >= 4 && perms[0] == 'r' && perms[1] == 'w' && perms[3] == 'p';
        n++;
    }
    if (!err && ferror(maps))
        err = errno ? errno : EIO;
    free(line);
    fclose(maps);
    if (err || !n) {
        free(list);
        errno = err ? err : EINVAL;
        return NULL;
    }
    *count = n;
    return list;
}

/* 1 when [lo, hi) lies entirely in private anonymous mappings (maps: load_maps'). */
static int
anonymous_private(const cow_map *maps, size_t n, uintptr_t lo, uintptr_t hi)
{
    size_t a = 0, b = n; /* the first mapping that ends past lo */
    while (a < b) {
        size_t mid = (a + b) / 2;
        if (maps[mid].end <= lo)
            a = mid + 1;
        else
            b = mid;
    }
    uintptr_t covered = lo;
    for (size_t i = a; i < n && covered < hi; i++) {
        if (maps[i].start > covered || !maps[i].ok)
            return 0;
        covered = maps[i].end;
    }
    return covered >= hi;
}

/* Before anything is laid out (whose size follows the regions'): every region a span of private
 * anonymous memory that does not wrap around the address space. 0, or an errno with why. */
static int
check_regions(const uintptr_t *addrs, const size_t *sizes, size_t n, size_t page, char *why, size_t why_len)
{
    for (size_t i = 0; i < n; i++)
        if (sizes[i] && (sizes[i] > UINTPTR_MAX - page || addrs[i] > UINTPTR_MAX - page - sizes[i])) {
            snprintf(why, why_len, "region %zu (%#lx+%zu) wraps around the address space", i, (unsigned long)addrs[i],
                     sizes[i]);
            return EINVAL;
        }
    size_t count = 0;
    cow_map *maps = load_maps(&count);
    if (!maps)
        return set_error(why, why_len, errno, "/proc/self/maps");
    int err = 0;
    for (size_t i = 0; !err && i < n; i++) {
        uintptr_t lo = addrs[i] / page * page, hi = (addrs[i] + sizes[i] + page - 1) / page * page;
        if (sizes[i] && !anonymous_private(maps, count, lo, hi))
            err = set_error(why, why_len, EINVAL, "memory that is not private anonymous (shared or file-backed)");
    }
    free(maps);
    return err;
}

int
cow_create(const uintptr_t *addrs, const size_t *sizes, size_t n, cow_snap **out, char *why, size_t why_len)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    int err = check_regions(addrs, sizes, n, page, why, why_len);
    if (err)
        return err;
    cow_snap *s = layout(addrs, sizes, n, page);
    if (!s)
        return set_error(why, why_len, errno, "mmap");
    pthread_rwlock_init(&s->gate, NULL);
    pthread_mutex_init(&s->alloc_lock, NULL);
    for (size_t i = 0; i < s->nlocks; i++)
        pthread_mutex_init(&s->locks[i], NULL);
    err = handshake(s, why, why_len);
    s->safe_read = probe_safe_read();
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
    size_t registered = 0;
    if (!err)
        live_add(s); /* before anything is protected */
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
        if (s->listed)
            live_remove(s); /* after the last unprotection */
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
