/* cow_pages.c: the page states of a snapshot (cow.c): the fault handler thread that copies a page
 * aside on its first write, and the copy-out that reads pages and unprotects those read in full.
 *
 * Per page, under the lock of its chunk: PROTECTED (unchanged, still protected), COPIED (the side
 * copy holds the snapshot), AHEAD (the same, copied by the run around another page's fault and not
 * known to be written: at most ahead_max of those are held), DONE (read out, unprotected), LOST
 * (written when no memory was left for its side copy: its copy-out fails, the writer is never kept
 * waiting), DROPPED (still protected when madvise(DONTNEED/FREE) dropped it: its copy-out fails too,
 * where the kernel tells the handler (UFFD_EVENT_REMOVE); elsewhere the copy-out reads zeros), GONE
 * (still protected when munmap or mremap took it away, UFFD_EVENT_UNMAP/REMAP, or found unreadable:
 * its copy-out fails; its address is never read again).
 *
 * The live memory is read with process_vm_readv where it works (safe_read): an munmap's event comes
 * after the unmap, so a page may go between the check of its state and its read; the syscall then
 * fails (EFAULT) where a memcpy would kill the process (SIGSEGV).
 */
#include "cow_impl.h"

#ifdef __linux__

int
cow_write_protect(cow_snap *s, uintptr_t start, size_t len, int on)
{
    struct uffdio_writeprotect wp = {.range = {.start = start, .len = len}, .mode = on ? UFFDIO_WRITEPROTECT_MODE_WP : 0};
    for (;;) {  /* EAGAIN: the address space is changing (mremap, fork); the call can be repeated */
        if (ioctl(s->uffd, UFFDIO_WRITEPROTECT, &wp) == 0)
            return 0;
        if (errno != EAGAIN && errno != EINTR)
            return -1;
        if (errno == EAGAIN)
            sched_yield(); /* until the handler has read the event of that change */
    }
}

/* Copy the live memory of the remote iovecs into the local ones (as many as each, page-sized or
 * one run each): the bytes copied, in order; fewer where the memory is no longer mapped (never a
 * fault: process_vm_readv; memcpy where that syscall is refused). */
static size_t
read_live(cow_snap *s, const struct iovec *local, const struct iovec *remote, size_t n)
{
    size_t total = 0;
    if (!s->safe_read) {
        for (size_t i = 0; i < n; i++) {
            memcpy(local[i].iov_base, remote[i].iov_base, remote[i].iov_len);
            total += remote[i].iov_len;
        }
        return total;
    }
    size_t i = 0, off = 0; /* the first byte not yet copied: remote[i], off bytes in */
    while (i < n) {
        struct iovec l = {.iov_base = (char *)local[i].iov_base + off, .iov_len = local[i].iov_len - off};
        struct iovec r = {.iov_base = (char *)remote[i].iov_base + off, .iov_len = remote[i].iov_len - off};
        long got;
        if (off) /* the rest of a partly read one, alone */
            got = syscall(SYS_process_vm_readv, (long)s->pid, &l, 1L, &r, 1L, 0L);
        else
            got = syscall(SYS_process_vm_readv, (long)s->pid, local + i, (long)(n - i), remote + i, (long)(n - i), 0L);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        total += (size_t)got;
        for (size_t left = (size_t)got; left && i < n;) {
            size_t rest = remote[i].iov_len - off;
            if (left < rest) {
                off += left;
                left = 0;
            } else {
                left -= rest;
                off = 0;
                i++;
            }
        }
    }
    return total;
}

/* The range (registration) holding addr, or NULL. */
cow_range *
cow_find_range(cow_snap *s, uintptr_t addr)
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
            return r;
    }
    return NULL;
}

/* The global index of the page at addr, or -1 when it is in none of the ranges. */
long
cow_page_index(cow_snap *s, uintptr_t addr)
{
    cow_range *r = cow_find_range(s, addr);
    return r ? (long)(r->first + (addr - r->addr) / s->page) : -1;
}

/* A side page: never malloc, which may write to protected heap pages (see the top). */
static void *
side_alloc(cow_snap *s, int ahead)
{
    void *p = NULL;
    pthread_mutex_lock(&s->alloc_lock);
    if (ahead && s->ahead_live >= s->ahead_max) {
        pthread_mutex_unlock(&s->alloc_lock);
        return NULL; /* over the budget: the page stays protected, as without memory */
    }
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
        s->ahead += ahead != 0;
        s->ahead_live += ahead != 0;
        if (++s->live > s->peak)
            s->peak = s->live;
    } else if (!ahead) {
        s->lost++; /* a page ahead that finds no memory stays protected instead */
    }
    pthread_mutex_unlock(&s->alloc_lock);
    return p;
}

static void
side_free(cow_snap *s, void *p, int ahead)
{
    pthread_mutex_lock(&s->alloc_lock);
    *(void **)p = s->free_list;
    s->free_list = p;
    s->live--;
    s->ahead_live -= ahead != 0;
    pthread_mutex_unlock(&s->alloc_lock);
}

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
static void
unprotect_run(cow_snap *s, uintptr_t lo, size_t len)
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
        unprotect_run(s, to, len);
}

/* The run to copy for a fault at addr in range r: follows a sweep if the fault carries on where one
 * of the last runs ended (either way), else starts small. Handler thread only. */
static cow_stream *
pick_run(cow_snap *s, cow_range *r, uintptr_t addr, size_t *pages, int *followed)
{
    *followed = 0;
    cow_stream *victim = &s->streams[0];
    for (int i = 0; i < STREAMS; i++) {
        cow_stream *e = &s->streams[i];
        uintptr_t span = e->pages * s->page;
        if (!e->pages)
            continue;
        if ((addr >= e->hi && addr - e->hi < span) || (addr < e->lo && e->lo - addr <= span)) {
            *pages = e->pages * 2 < s->run_max ? e->pages * 2 : s->run_max;
            *followed = 1;
            return e;
        }
        if (addr >= e->lo && addr < e->hi) { /* another writer of the same page, queued meanwhile */
            *pages = e->pages;
            return e;
        }
        if (e->used < victim->used)
            victim = e;
    }
    *pages = s->run_min;
    /* Not followed (more sweeps than STREAMS, or one that started before): a fault on the first
     * page of a block whose previous page a fault copied aside looks like a sweep too. Random
     * writes seldom hit the first page of a block, so they seldom get the larger run. */
    uintptr_t block = s->run_min * s->page;
    if (addr % block == 0 && addr > r->addr) {
        size_t g = r->first + (addr - r->addr) / s->page - 1;
        pthread_mutex_t *lock = &s->locks[g / CHUNK_PAGES];
        pthread_mutex_lock(lock);
        if (s->state[g] == COPIED || s->state[g] == AHEAD)
            *pages = s->run_min * 2 < s->run_max ? s->run_min * 2 : s->run_max;
        pthread_mutex_unlock(lock);
    }
    return victim;
}

/* Keep the snapshot value of pages [g, g + n) (at addr) of one chunk, under its lock, where nobody
 * has yet: taken from the bottom up, or from the top down; their live memory read in one call. The
 * pages handled from that end on: all n, or fewer where a page ahead found no memory (it stays
 * protected, and so does the rest) or could not be read (gone: its unmap is reported later). The
 * faulting page itself (ahead 0, n 1) never keeps its writer waiting: without memory it is LOST,
 * unreadable it is GONE (a write to memory being unmapped), and its copy-out fails instead. */
static size_t
keep_pages(cow_snap *s, size_t g, uintptr_t addr, size_t n, int ahead, int down)
{
    struct iovec local[CHUNK_PAGES], remote[CHUNK_PAGES];
    size_t at[CHUNK_PAGES], k = 0, handled = 0;
    for (size_t i = 0; i < n; i++, handled++) {
        size_t j = down ? n - 1 - i : i;
        if (s->state[g + j] != PROTECTED)
            continue;
        void *copy = side_alloc(s, ahead);
        if (!copy) {
            if (ahead)
                break;
            s->state[g + j] = LOST;
            continue;
        }
        local[k] = (struct iovec){.iov_base = copy, .iov_len = s->page};
        remote[k] = (struct iovec){.iov_base = (void *)(addr + j * s->page), .iov_len = s->page};
        at[k++] = j;
    }
    size_t ok = k ? read_live(s, local, remote, k) / s->page : 0; /* read in full, in that order */
    for (size_t i = 0; i < k; i++) {
        size_t gj = g + at[i];
        if (i < ok) {
            s->side[gj] = local[i].iov_base;
            s->state[gj] = ahead ? AHEAD : COPIED;
            continue;
        }
        side_free(s, local[i].iov_base, ahead);
        if (!ahead) {
            s->state[gj] = GONE;
            pthread_mutex_lock(&s->alloc_lock);
            s->lost++;
            pthread_mutex_unlock(&s->alloc_lock);
        } else if (i == ok) {
            handled = down ? n - 1 - at[i] : at[i]; /* the run ends before the first page unread */
        }
    }
    return handled;
}

/* A sweep went on past the run [lo, hi): its pages copied ahead were written by it, so they no
 * longer count against the budget of pages copied ahead. Handler thread; no lock held. */
static void
credit_run(cow_snap *s, cow_range *r, uintptr_t lo, uintptr_t hi)
{
    uintptr_t r_end = r->addr + r->npages * s->page;
    lo = lo > r->addr ? lo : r->addr;
    hi = hi < r_end ? hi : r_end;
    size_t n = 0;
    for (uintptr_t a = lo; a < hi; a += s->page) {
        size_t g = r->first + (a - r->addr) / s->page;
        pthread_mutex_t *lock = &s->locks[g / CHUNK_PAGES];
        pthread_mutex_lock(lock);
        if (s->state[g] == AHEAD) {
            s->state[g] = COPIED;
            n++;
        }
        pthread_mutex_unlock(lock);
    }
    pthread_mutex_lock(&s->alloc_lock);
    s->ahead_live -= n;
    pthread_mutex_unlock(&s->alloc_lock);
}

/* Hold the lock of page g's chunk (and no other). */
static void
hold(cow_snap *s, long *held, size_t g)
{
    long chunk = (long)(g / CHUNK_PAGES);
    if (chunk != *held) {
        if (*held >= 0)
            pthread_mutex_unlock(&s->locks[*held]);
        pthread_mutex_lock(&s->locks[chunk]);
        *held = chunk;
    }
}

/* A write fault: keep the snapshot value of the still-protected pages of a run around the
 * faulting page (pick_run), then unprotect the run in one call, which wakes the writer. Pages read
 * out (DONE) or copied meanwhile are in the run too: unprotecting them again costs nothing.
 *
 * The extra memory beyond the pages written before the reader got to them: the pages copied ahead
 * and held (AHEAD), at most ahead_max; a sweep that goes on past a run turns that run's pages to
 * COPIED (written by the sweep). A fault right behind the reader copies the rest of the reader's
 * 2 MiB, freed as it reads on. */
static void
on_fault(cow_snap *s, uintptr_t addr)
{
    size_t page = s->page;
    addr &= ~(uintptr_t)(page - 1);
    __atomic_fetch_add(&s->faults, 1, __ATOMIC_RELAXED);
    cow_range *r = cow_find_range(s, addr);
    if (!r) {
        unprotect_run(s, addr, page);
        return;
    }
    size_t pages, gf = r->first + (addr - r->addr) / page;
    int followed;
    cow_stream *e = pick_run(s, r, addr, &pages, &followed);
    if (followed)
        credit_run(s, r, e->lo, e->hi);
    /* A page read out whose protection the reader has not lifted yet (it does so per 2 MiB): the
     * writer follows the reader, so take the whole huge page at once, which the kernel unprotects
     * without splitting it; the pages copied ahead there are those the reader reads next. */
    pthread_mutex_lock(&s->locks[gf / CHUNK_PAGES]);
    if (s->state[gf] == DONE)
        pages = s->run_max;
    pthread_mutex_unlock(&s->locks[gf / CHUNK_PAGES]);
    uintptr_t span = pages * page, r_end = r->addr + r->npages * page;
    uintptr_t lo = addr - addr % span, hi = lo + span; /* aligned: a whole huge page at run_max */
    lo = lo > r->addr ? lo : r->addr;
    hi = hi < r_end ? hi : r_end;
    size_t g0 = r->first + (lo - r->addr) / page;
    size_t n = (hi - lo) / page, first = gf - g0, last = first + 1; /* pages [first, last) of the run kept */
    /* The faulting page, then on up, then down, a chunk at a time (its lock held, never across
     * the ioctl); a page ahead without memory, or unreadable, ends the run there. */
    long held = -1;
    hold(s, &held, gf);
    keep_pages(s, gf, addr, 1, 0, 0);
    while (last < n) {
        size_t g = g0 + last, stop = last + (CHUNK_PAGES - g % CHUNK_PAGES);
        stop = stop < n ? stop : n;
        hold(s, &held, g);
        size_t got = keep_pages(s, g, lo + last * page, stop - last, 1, 0);
        last += got;
        if (last < stop)
            break;
    }
    while (first > 0) {
        size_t g = g0 + first - 1, in = g % CHUNK_PAGES, bottom = first - 1 > in ? first - 1 - in : 0;
        hold(s, &held, g);
        size_t want = first - bottom, got = keep_pages(s, g0 + bottom, lo + bottom * page, want, 1, 1);
        first -= got;
        if (got < want)
            break;
    }
    if (held >= 0)
        pthread_mutex_unlock(&s->locks[held]);
    e->lo = lo + first * page;
    e->hi = lo + last * page;
    e->pages = pages;
    e->used = ++s->stream_clock;
    unprotect_run(s, lo + first * page, (last - first) * page);
}

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
         * take_live). */
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
                on_fault(s, (uintptr_t)msgs[i].arg.pagefault.address);
        if (removes && seq_on)
            __atomic_fetch_add(&s->remove_seq, 1, __ATOMIC_SEQ_CST);
    }
    return NULL;
}

/* Count bytes [addr, addr + len) of global page g (in state st), of array a, read out; under the
 * page's chunk lock. 1 when the page became DONE (to unprotect), else 0. */
static int
account(cow_snap *s, cow_array *a, size_t g, uint8_t st, uintptr_t addr, size_t len)
{
    uintptr_t page_addr = addr & ~(uintptr_t)(s->page - 1);
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
    if (st == COPIED || st == AHEAD) {
        side_free(s, s->side[g], st == AHEAD);
        s->side[g] = NULL;
    }
    s->state[g] = DONE;
    return 1;
}

/* Copy bytes [addr, addr + len) of global page g, of array a, to dst and count them read out, where
 * the page is not PROTECTED (those are read in runs: take_live); under the page's chunk lock. 1 when
 * the page became DONE (to unprotect), 0, or -errno. */
static int
take(cow_snap *s, cow_array *a, size_t g, uintptr_t addr, size_t len, char *dst)
{
    uintptr_t page_addr = addr & ~(uintptr_t)(s->page - 1);
    uint8_t st = s->state[g];
    if (st == DONE)
        return -EALREADY;  /* read out in full before (and maybe written since): refuse, never guess */
    if (st == LOST)
        return -ENOMEM;
    if (st == DROPPED)
        return -ENODATA;
    if (st != COPIED && st != AHEAD)
        return -EFAULT;    /* GONE: unmapped or moved away before it was read out */
    memcpy(dst, (const char *)s->side[g] + (addr - page_addr), len);
    return account(s, a, g, st, addr, len);
}

/* Bytes per read of live memory (take_live): what is read again when a check fails. */
#define LIVE_PIECE (64u << 10)

/* Copy bytes [addr, addr + len) of array a, whose pages are all PROTECTED (unchanged, so read from
 * memory), to dst, a piece of up to LIVE_PIECE at a time, and count them read out (pages[], done[]
 * from *npages on, as take's results); under their chunk's lock. 0, or -errno; *taken: the bytes
 * read and counted before that.
 *
 * A madvise may drop pages, or an munmap/mremap go on to map other memory there, while the handler
 * reads their event and before mark_range marks them (the remove_seq window): a piece counts only if
 * no such window was open at any time of its read (remove_seq even before and after, event_gen
 * unchanged); else -EAGAIN, and the caller waits for the window to close (this chunk's lock
 * released) and takes the rest again. An munmap's event comes after the unmap, so pages may be gone
 * before any window: the read fails there (safe_read), -EFAULT. */
static int
take_live(cow_snap *s, cow_array *a, uintptr_t addr, size_t len, char *dst, uintptr_t *pages, int *done,
          size_t *npages, size_t *taken)
{
    int seq_on = s->remove_events || s->unmap_events;
    *taken = 0;
    for (uintptr_t at = addr, end = addr + len; at < end;) {
        uintptr_t stop = (at & ~(uintptr_t)(s->page - 1)) + LIVE_PIECE;
        stop = stop < end ? stop : end;
        size_t seq = 0, gen = 0;
        if (seq_on) {
            seq = __atomic_load_n(&s->remove_seq, __ATOMIC_ACQUIRE);
            if (seq & 1)
                return -EAGAIN;
            gen = __atomic_load_n(&s->event_gen, __ATOMIC_ACQUIRE);
        }
        struct iovec local = {.iov_base = dst + (at - addr), .iov_len = stop - at};
        struct iovec remote = {.iov_base = (void *)at, .iov_len = stop - at};
        size_t got = read_live(s, &local, &remote, 1);
        if (seq_on) {
            /* The copy's loads before the loads below: an acquire fence is enough (a full one, a
             * store-buffer drain, cost the copy-out a third of its speed when taken per page). */
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if ((__atomic_load_n(&s->remove_seq, __ATOMIC_ACQUIRE) & 1) ||
                __atomic_load_n(&s->event_gen, __ATOMIC_RELAXED) != gen)
                return -EAGAIN;
        }
        if (got != stop - at)
            return -EFAULT;
        for (uintptr_t p = at; p < stop;) {
            uintptr_t page_addr = p & ~(uintptr_t)(s->page - 1);
            size_t n = (page_addr + s->page < stop ? page_addr + s->page : stop) - p;
            size_t g = a->first + (page_addr - a->page0) / s->page;
            pages[*npages] = page_addr;
            done[(*npages)++] = account(s, a, g, PROTECTED, p, n);
            p += n;
        }
        *taken += stop - at;
        at = stop;
    }
    return 0;
}

/* Pages per bounce: a batch is copied under one chunk lock, then written out with none held. */
#define BATCH_PAGES 16

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
    /* The output is written with a chunk lock held only where no snapshot protects it. Its pages
     * may be protected: by this snapshot (a small buffer in the heap next to a small array), or by
     * another live one (two snapshots copied out at once, each into memory the other protects).
     * Writing them faults into a handler that needs a chunk lock; held by this writer, or by the
     * other snapshot's reader waiting the same way, nobody would go on. There, up to BATCH_PAGES
     * pages of one chunk are copied under its lock into a bounce buffer (mapped here, never
     * protected), then into the output with no lock held: the lock still covers every read of the
     * snapshot's pages. Elsewhere the pages go straight to the output, a chunk per lock: a snapshot
     * taken after this check over the output bounces its own copy-outs (it finds this one live),
     * so no two readers can wait for each other. */
    int direct = !cow_out_protected((uintptr_t)out, (uintptr_t)out + n);
    size_t batch = direct ? CHUNK_PAGES : BATCH_PAGES;
    char *bounce = NULL;
    if (n && !direct) {
        bounce = mmap(NULL, BATCH_PAGES * s->page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (bounce == MAP_FAILED) {
            pthread_rwlock_unlock(&s->gate);
            return ENOMEM;
        }
    }
    int err = 0;
    uintptr_t addr = a->addr + start, end = addr + n;
    /* Pages that became DONE, unprotected in one call per contiguous run, cut at huge-page
     * boundaries (so whole PMDs are unprotected, without a split, and writers do not wait long
     * on pages read out but still protected); never with a chunk lock held. */
    uintptr_t run_lo = 0, run_hi = 0, huge = RUN_MAX_BYTES > s->page ? RUN_MAX_BYTES : s->page;
#define FLUSH()                                                                                 \
    do {                                                                                        \
        if (run_hi > run_lo && cow_write_protect(s, run_lo, run_hi - run_lo, 0) != 0 && !err && \
            errno != ENOENT) /* ENOENT: unmapped since they were read, nothing to unprotect */   \
            err = errno;                                                                        \
        run_lo = run_hi = 0;                                                                    \
    } while (0)
    while (addr < end && !err) {
        uintptr_t pages[CHUNK_PAGES];
        int done[CHUNK_PAGES];
        size_t seen = 0, npages = 0, used = 0;
        long chunk = -1;
        int rc = 0;
        char *base = direct ? out : bounce;
        /* The PROTECTED pages met in a row: [live, addr) to base + live_used, read in one call. */
        uintptr_t live = 0;
        size_t live_used = 0, taken = 0;
        while (addr < end && seen < batch) {
            uintptr_t page_addr = addr & ~(uintptr_t)(s->page - 1);
            size_t len = (page_addr + s->page < end ? page_addr + s->page : end) - addr;
            size_t g = a->first + (page_addr - a->page0) / s->page;
            if (chunk < 0) {
                chunk = (long)(g / CHUNK_PAGES);
                pthread_mutex_lock(&s->locks[chunk]);
            } else if ((long)(g / CHUNK_PAGES) != chunk) {
                break;
            }
            if (s->state[g] == PROTECTED) {
                if (!live) {
                    live = addr;
                    live_used = used;
                }
            } else {
                if (live) {
                    rc = take_live(s, a, live, addr - live, base + live_used, pages, done, &npages, &taken);
                    if (rc < 0)
                        break;
                    live = 0;
                }
                rc = take(s, a, g, addr, len, base + used);
                if (rc < 0)
                    break;
                pages[npages] = page_addr;
                done[npages++] = rc == 1;
            }
            seen++;
            used += len;
            addr += len;
        }
        if (live && rc >= 0)
            rc = take_live(s, a, live, addr - live, base + live_used, pages, done, &npages, &taken);
        if (live && rc < 0) { /* the run counted up to taken: on from there again, or the error */
            addr = live + taken;
            used = live_used + taken;
        }
        if (chunk >= 0)
            pthread_mutex_unlock(&s->locks[chunk]);
        if (!direct)
            memcpy(out, bounce, used);
        out += used;
        for (size_t i = 0; i < npages && !err; i++) {
            if (run_hi > run_lo && pages[i] % huge == 0)
                FLUSH();
            if (!done[i])
                continue;
            if (run_hi != pages[i]) {
                if (run_hi > run_lo)
                    FLUSH();
                run_lo = pages[i];
            }
            run_hi = pages[i] + s->page;
        }
        if (rc == -EAGAIN) /* pages dropped or unmapped being marked (take_live): wait, then these again */
            while (__atomic_load_n(&s->remove_seq, __ATOMIC_ACQUIRE) & 1)
                sched_yield();
        else if (rc < 0 && !err)
            err = -rc;
    }
    FLUSH();
#undef FLUSH
    if (bounce)
        munmap(bounce, BATCH_PAGES * s->page);
    pthread_rwlock_unlock(&s->gate);
    return err;
}

void
cow_stats(cow_snap *s, cow_stat *st)
{
    pthread_mutex_lock(&s->alloc_lock);
    st->pages_copied = s->copied;
    st->pages_copied_ahead = s->ahead;
    st->faults = __atomic_load_n(&s->faults, __ATOMIC_RELAXED);
    st->pages_lost = s->lost;
    st->peak_bytes = s->peak * s->page;
    st->live_bytes = s->live * s->page;
    st->pages = s->npages;
    st->ranges = s->nranges;
    st->unpopulated_protected = s->populated;
    st->drops_reported = s->remove_events;
    pthread_mutex_unlock(&s->alloc_lock);
}


#else /* not Linux: cow.c refuses to create a snapshot, so none of these is reached */

int cow_copy_out(cow_snap *s, size_t j, size_t start, char *out, size_t n) { return ENOSYS; }
void cow_stats(cow_snap *s, cow_stat *st) { memset(st, 0, sizeof *st); }

#endif
