/* cow_events.c: the handler thread of a snapshot (cow_handler), which reads the userfaultfd: write
 * faults go to cow_fault.c; madvise(DONTNEED/FREE), munmap and mremap events (UFFD_EVENT_REMOVE,
 * UNMAP, REMAP) mark the pages still protected there DROPPED or GONE, so that their copy-out fails
 * instead of reading zeros or memory that is no longer there. Also the handler's unprotection of a
 * run (cow_unprotect_run), which must not wait for the handler itself: a run the kernel refuses
 * while a madvise waits for its event is deferred and retried after the next read. Apart from the
 * fault path because these events are what the copy-out's remove_seq/event_gen checks are about
 * (cow_copyout.c: take_live).
 */
#include "cow_impl.h"

#ifdef __linux__

/* Unprotecting [lo, lo + len) failed otherwise than EAGAIN: part of it is no longer a protected
 * mapping (unmapped or moved: ENOENT), and the kernel stops there. Unprotect the rest page by page,
 * then wake whoever waits in it (a writer of memory now gone retries and meets what is there). */
static void
unprotect_remains(cow_snap *s, uintptr_t lo, size_t len)
{
    for (uintptr_t p = lo; len > s->page && p < lo + len; p += s->page) {
        struct uffdio_writeprotect one = {.range = {.start = p, .len = s->page}, .mode = UFFDIO_WRITEPROTECT_MODE_DONTWAKE};
        while (ioctl(s->uffd, UFFDIO_WRITEPROTECT, &one) != 0 && errno == EINTR)
            ;
    }
    struct uffdio_range range = {.start = lo, .len = len};
    while (ioctl(s->uffd, UFFDIO_WAKE, &range) != 0 && errno == EINTR)
        ;
}

/* Unprotect a run from the handler thread. While a madvise waits for the handler to read its
 * UFFD_EVENT_REMOVE, the kernel refuses with EAGAIN (mmap_changing): retrying here would wait for
 * this very thread, so the run is kept and retried after the next read (retry_deferred). */
void
cow_unprotect_run(cow_snap *s, uintptr_t lo, size_t len)
{
    struct uffdio_writeprotect wp = {.range = {.start = lo, .len = len}, .mode = 0};
    while (ioctl(s->uffd, UFFDIO_WRITEPROTECT, &wp) != 0) {
        if (errno == EINTR)
            continue;
        /* Past DEFER_MAX (as many writers blocked at once): the writer waits until the reader or
         * release() unprotects its pages; nothing better can be done here. */
        if (errno == EAGAIN) {
            if (s->ndeferred < DEFER_MAX)
                s->deferred[s->ndeferred++] = (cow_defer){.lo = lo, .len = len};
            return;
        }
        unprotect_remains(s, lo, len);
        return;
    }
}

static void
retry_deferred(cow_snap *s)
{
    size_t kept = 0;
    for (size_t i = 0; i < s->ndeferred; i++) {
        struct uffdio_writeprotect wp = {.range = {.start = s->deferred[i].lo, .len = s->deferred[i].len}, .mode = 0};
        int rc;
        while ((rc = ioctl(s->uffd, UFFDIO_WRITEPROTECT, &wp)) != 0 && errno == EINTR)
            ;
        if (rc != 0 && errno == EAGAIN)
            s->deferred[kept++] = s->deferred[i];
        else if (rc != 0)
            unprotect_remains(s, s->deferred[i].lo, s->deferred[i].len);
    }
    s->ndeferred = kept;
}

/* Pages of [start, end) are losing their snapshot value without a fault: madvise(DONTNEED/FREE)
 * is about to drop them (UFFD_EVENT_REMOVE: mark DROPPED), or munmap/mremap took them away
 * (UFFD_EVENT_UNMAP/REMAP: mark GONE). The pages there still protected are marked, so that their
 * copy-out fails rather than read zeros or whatever is mapped there now; the side copies (COPIED,
 * AHEAD) keep theirs. */
static void
mark_range(cow_snap *s, uintptr_t start, uintptr_t end, uint8_t mark)
{
    size_t marked = 0;
    for (size_t i = 0; i < s->nranges; i++) {
        cow_range *r = &s->ranges[i];
        uintptr_t r_end = r->addr + r->npages * s->page;
        uintptr_t lo = start > r->addr ? start : r->addr, hi = end < r_end ? end : r_end;
        if (lo >= hi)
            continue;
        size_t g0 = r->first + (lo - r->addr) / s->page, g1 = r->first + (hi - r->addr + s->page - 1) / s->page;
        long held = -1;
        for (size_t g = g0; g < g1; g++) {
            long chunk = (long)(g / CHUNK_PAGES);
            if (chunk != held) {
                if (held >= 0)
                    pthread_mutex_unlock(&s->locks[held]);
                pthread_mutex_lock(&s->locks[chunk]);
                held = chunk;
            }
            if (s->state[g] == PROTECTED) {
                s->state[g] = mark;
                marked++;
            }
        }
        if (held >= 0)
            pthread_mutex_unlock(&s->locks[held]);
    }
    if (marked) {
        pthread_mutex_lock(&s->alloc_lock);
        s->lost += marked;
        pthread_mutex_unlock(&s->alloc_lock);
    }
}

/* munmap (or an mremap that shrinks or moves over it) took [start, end) away; the event comes once
 * it is done. Writers that were waiting on pages there are woken: they retry on what is there. */
static void
on_unmap(cow_snap *s, uintptr_t start, uintptr_t end)
{
    mark_range(s, start, end, GONE);
    struct uffdio_range range = {.start = start, .len = end - start};
    while (end > start && ioctl(s->uffd, UFFDIO_WAKE, &range) != 0 && errno == EINTR)
        ;
}

/* mremap moved [from, from + len) to [to, to + len) (a realloc: ndarray.resize(refcheck=False)):
 * the old addresses are gone. The moved memory keeps this registration and its protection there
 * (EVENT_REMAP): it is the application's new buffer, not the snapshot's, so let it go (unregister:
 * the kernel lifts the protection and wakes its writers; else unprotect it). */
static void
on_remap(cow_snap *s, uintptr_t from, uintptr_t to, size_t len)
{
    on_unmap(s, from, from + len);
    struct uffdio_range range = {.start = to, .len = len};
    int rc;
    while ((rc = ioctl(s->uffd, UFFDIO_UNREGISTER, &range)) != 0 && errno == EINTR)
        ;
    if (rc != 0 && len)
        cow_unprotect_run(s, to, len);
}

/* The handler thread: started by cow_create, stopped by cow_release through the eventfd. */
void *
cow_handler(void *arg)
{
    cow_snap *s = arg;
    int seq_on = s->remove_events || s->unmap_events;
    struct uffd_msg msgs[32];
    struct pollfd fds[2] = {{.fd = s->uffd, .events = POLLIN}, {.fd = s->evfd, .events = POLLIN}};
    for (;;) {
        if (s->ndeferred)
            retry_deferred(s);
        if (poll(fds, 2, s->ndeferred ? 1 : -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (fds[1].revents)
            break;
        if (!fds[0].revents)
            continue;
        /* Odd from before the read: a madvise whose UFFD_EVENT_REMOVE this read hands over drops its
         * pages as soon as the read returns, before mark_range has marked them, and an munmap or
         * mremap whose event it hands over goes on, maybe to map other memory there (see
         * take_live, cow_copyout.c). */
        if (seq_on)
            __atomic_fetch_add(&s->remove_seq, 1, __ATOMIC_SEQ_CST);
        ssize_t n = read(s->uffd, msgs, sizeof msgs);
        size_t count = n > 0 ? (size_t)n / sizeof msgs[0] : 0;
        int removes = 0;
        for (size_t i = 0; i < count; i++)
            removes |= msgs[i].event != UFFD_EVENT_PAGEFAULT;
        if (seq_on && !removes)
            __atomic_fetch_add(&s->remove_seq, 1, __ATOMIC_SEQ_CST);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR)
                continue;
            break;
        }
        /* The events first: a fault read with them was raised before, but the pages an madvise
         * drops go as soon as this read returned, and those unmapped are gone already; marked
         * first, they are not read for the faults (their value is lost either way). */
        if (removes && seq_on)
            __atomic_fetch_add(&s->event_gen, 1, __ATOMIC_SEQ_CST);
        for (size_t i = 0; removes && i < count; i++)
            if (msgs[i].event == UFFD_EVENT_REMOVE)
                mark_range(s, (uintptr_t)msgs[i].arg.remove.start, (uintptr_t)msgs[i].arg.remove.end, DROPPED);
            else if (msgs[i].event == UFFD_EVENT_UNMAP)
                on_unmap(s, (uintptr_t)msgs[i].arg.remove.start, (uintptr_t)msgs[i].arg.remove.end);
            else if (msgs[i].event == UFFD_EVENT_REMAP)
                on_remap(s, (uintptr_t)msgs[i].arg.remap.from, (uintptr_t)msgs[i].arg.remap.to,
                         (size_t)msgs[i].arg.remap.len);
        for (size_t i = 0; i < count; i++)
            if (msgs[i].event == UFFD_EVENT_PAGEFAULT)
                cow_on_fault(s, (uintptr_t)msgs[i].arg.pagefault.address);
        if (removes && seq_on)
            __atomic_fetch_add(&s->remove_seq, 1, __ATOMIC_SEQ_CST);
    }
    return NULL;
}

#endif
