/* cow_pages.c: the page states of a snapshot (cow.c): the fault handler thread that copies a page
 * aside on its first write, and the copy-out that reads pages and unprotects those read in full.
 *
 * Per page, under the lock of its chunk: PROTECTED (unchanged, still protected), COPIED (the side
 * copy holds the snapshot), AHEAD (the same, copied by the run around another page's fault and not
 * known to be written: at most ahead_max of those are held), DONE (read out, unprotected), LOST
 * (written when no memory was left for its side copy: its copy-out fails, the writer is never kept
 * waiting), DROPPED (still protected when madvise(DONTNEED/FREE) dropped it: its copy-out fails too,
 * where the kernel tells the handler (UFFD_EVENT_REMOVE); elsewhere the copy-out reads zeros).
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
    }
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
        /* Past DEFER_MAX (as many writers blocked at once), or another failure: the writer waits
         * until the reader or release() unprotects its pages; nothing better can be done here. */
        if (errno == EAGAIN && s->ndeferred < DEFER_MAX)
            s->deferred[s->ndeferred++] = (cow_defer){.lo = lo, .len = len};
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
    }
    s->ndeferred = kept;
}

/* madvise(DONTNEED/FREE) is about to drop [start, end) (UFFD_EVENT_REMOVE, read): the pages there
 * still protected lose their snapshot value without a fault. Mark them DROPPED, so that their
 * copy-out fails rather than read zeros; the side copies (COPIED, AHEAD) keep theirs. */
static void
on_remove(cow_snap *s, uintptr_t start, uintptr_t end)
{
    size_t dropped = 0;
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
                s->state[g] = DROPPED;
                dropped++;
            }
        }
        if (held >= 0)
            pthread_mutex_unlock(&s->locks[held]);
    }
    if (dropped) {
        pthread_mutex_lock(&s->alloc_lock);
        s->lost += dropped;
        pthread_mutex_unlock(&s->alloc_lock);
    }
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

/* Keep the snapshot value of page g (at page_addr) if nobody has yet; under its chunk lock. 0, or
 * -1 for a page ahead that found no memory (it stays protected). The faulting page itself never
 * keeps its writer waiting: without memory it is LOST and its copy-out fails instead. */
static int
keep(cow_snap *s, size_t g, uintptr_t page_addr, int ahead)
{
    if (s->state[g] != PROTECTED)
        return 0;
    void *copy = side_alloc(s, ahead);
    if (!copy) {
        if (ahead)
            return -1;
        s->state[g] = LOST;
        return 0;
    }
    memcpy(copy, (const void *)page_addr, s->page);
    s->side[g] = copy;
    s->state[g] = ahead ? AHEAD : COPIED;
    return 0;
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
    /* The faulting page, then on up, then down; a page ahead without memory ends the run there.
     * One chunk lock at a time, never held across the ioctl. */
    long held = -1;
    hold(s, &held, gf);
    keep(s, gf, addr, 0);
    for (; last < n; last++) {
        hold(s, &held, g0 + last);
        if (keep(s, g0 + last, lo + last * page, 1) != 0)
            break;
    }
    for (; first > 0; first--) {
        hold(s, &held, g0 + first - 1);
        if (keep(s, g0 + first - 1, lo + (first - 1) * page, 1) != 0)
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
         * pages as soon as the read returns, before on_remove has marked them (see take). */
        if (s->remove_events)
            __atomic_fetch_add(&s->remove_seq, 1, __ATOMIC_SEQ_CST);
        ssize_t n = read(s->uffd, msgs, sizeof msgs);
        size_t count = n > 0 ? (size_t)n / sizeof msgs[0] : 0;
        int removes = 0;
        for (size_t i = 0; i < count; i++)
            removes |= msgs[i].event == UFFD_EVENT_REMOVE;
        if (s->remove_events && !removes)
            __atomic_fetch_add(&s->remove_seq, 1, __ATOMIC_SEQ_CST);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR)
                continue;
            break;
        }
        for (size_t i = 0; i < count; i++)
            if (msgs[i].event == UFFD_EVENT_PAGEFAULT)
                on_fault(s, (uintptr_t)msgs[i].arg.pagefault.address);
            else if (msgs[i].event == UFFD_EVENT_REMOVE)
                on_remove(s, (uintptr_t)msgs[i].arg.remove.start, (uintptr_t)msgs[i].arg.remove.end);
        if (removes)
            __atomic_fetch_add(&s->remove_seq, 1, __ATOMIC_SEQ_CST);
    }
    return NULL;
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
    if (st == DROPPED)
        return -ENODATA;
    if (st == PROTECTED && s->remove_events) {
        /* A madvise may drop the page while the handler reads its event and before on_remove marks
         * it (the remove_seq window): a page read from memory then counts only if no such window
         * was open at any time of the read; else -EAGAIN, and the caller waits for the window to
         * close (this chunk's lock released) and takes the page again. */
        size_t seq = __atomic_load_n(&s->remove_seq, __ATOMIC_ACQUIRE);
        if (seq & 1)
            return -EAGAIN;
        memcpy(dst, (const char *)addr, len);
        /* The copy's loads before the load below: an acquire fence is enough (a full one, a
         * store-buffer drain per page, cost the copy-out a third of its speed). */
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&s->remove_seq, __ATOMIC_RELAXED) != seq)
            return -EAGAIN;
    } else {
        memcpy(dst, st == COPIED || st == AHEAD ? (const char *)s->side[g] + (addr - page_addr) : (const char *)addr, len);
    }
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
        if (run_hi > run_lo && cow_write_protect(s, run_lo, run_hi - run_lo, 0) != 0 && !err)   \
            err = errno;                                                                        \
        run_lo = run_hi = 0;                                                                    \
    } while (0)
    while (addr < end && !err) {
        uintptr_t pages[CHUNK_PAGES];
        int done[CHUNK_PAGES];
        size_t npages = 0, used = 0;
        long chunk = -1;
        int rc = 0;
        while (addr < end && npages < batch) {
            uintptr_t page_addr = addr & ~(uintptr_t)(s->page - 1);
            size_t len = (page_addr + s->page < end ? page_addr + s->page : end) - addr;
            size_t g = a->first + (page_addr - a->page0) / s->page;
            if (chunk < 0) {
                chunk = (long)(g / CHUNK_PAGES);
                pthread_mutex_lock(&s->locks[chunk]);
            } else if ((long)(g / CHUNK_PAGES) != chunk) {
                break;
            }
            rc = take(s, a, g, addr, len, direct ? out + used : bounce + used);
            if (rc < 0)
                break;
            pages[npages] = page_addr;
            done[npages++] = rc == 1;
            used += len;
            addr += len;
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
        if (rc == -EAGAIN) /* a madvise's pages being marked (take): wait for it, then this page again */
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
