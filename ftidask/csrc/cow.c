/* cow.c: a copy-on-write snapshot of memory ranges, for asynchronous checkpoints (issue 15).
 *
 * An asynchronous checkpoint must write the values the arrays had at the call while the
 * application goes on writing them. Copying everything first doubles the memory and blocks the
 * application for a memcpy of the whole state; here the pages are write-protected instead
 * (userfaultfd, synchronous write-protect mode), which blocks it for a page-table walk only:
 *
 *  - the first write to a protected page, by any thread or by the kernel itself (read(2) into
 *    the array: hence no UFFD_USER_MODE_ONLY), stops the writer; a handler thread (cow_events.c)
 *    copies the page aside and lifts the protection, which wakes the writer; in fact a run of
 *    pages around it, which grows while the faults sweep on (cow_fault.c: one fault per 2 MiB);
 *  - the background reader (cow_copy_out, cow_copyout.c) takes each page from its side copy if
 *    there is one, else from memory (still protected, so unchanged), then lifts the protection of
 *    the pages it has read in full: later writes to them cost nothing;
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
 * This file sets a snapshot up (the userfaultfd context, the handler thread, the registrations,
 * the list of live snapshots) and tears it down. Its parts, one job each: cow_layout.c (the checks
 * of the regions and the one mmap'ed block of state), cow_uffd.c (the userfaultfd context and its
 * features), cow_pages.c (the per-page states and the primitives on them), cow_fault.c (a write
 * fault), cow_events.c (the handler thread and the events of madvise, munmap and mremap),
 * cow_copyout.c (the background reader), cow_py.c (the Python entry points).
 */
#include <stdio.h>
#include "cow_impl.h"

#ifdef __linux__

/* why: "what: strerror(err)"; returns err (for the set-up in cow.c, cow_uffd.c and cow_layout.c). */
int
cow_set_error(char *why, size_t why_len, int err, const char *what)
{
    snprintf(why, why_len, "%s: %s", what, strerror(err));
    return err;
}

/* The snapshots of this process from before their first protection until after their last:
 * cow_copy_out writes its output with a chunk lock held only where none of them protects it (see
 * there, cow_copyout.c). A fork in the middle of a change leaves the child the lock released (atfork). */
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

int
cow_create(const uintptr_t *addrs, const size_t *sizes, size_t n, cow_snap **out, char *why, size_t why_len)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    int err = cow_check_regions(addrs, sizes, n, page, why, why_len);
    if (err)
        return err;
    cow_snap *s = cow_layout(addrs, sizes, n, page);
    if (!s)
        return cow_set_error(why, why_len, errno, "mmap");
    pthread_rwlock_init(&s->gate, NULL);
    pthread_mutex_init(&s->alloc_lock, NULL);
    for (size_t i = 0; i < s->nlocks; i++)
        pthread_mutex_init(&s->locks[i], NULL);
    err = cow_handshake(s, why, why_len);
    s->safe_read = cow_probe_safe_read();
    if (!err) {
        s->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (s->evfd < 0)
            err = cow_set_error(why, why_len, errno, "eventfd");
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
            cow_set_error(why, why_len, err, "pthread_create");
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
            err = cow_set_error(why, why_len, EOPNOTSUPP, "UFFDIO_WRITEPROTECT on this memory");
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
            err = cow_set_error(why, why_len, errno, "UFFDIO_WRITEPROTECT");
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
