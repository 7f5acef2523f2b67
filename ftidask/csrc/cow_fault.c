/* cow_fault.c: a write fault on a protected page (cow_on_fault, called by the handler thread of
 * cow_events.c): the snapshot value of the page, and of a run of pages around it, is copied aside
 * and the run unprotected, which wakes the writer. Runs grow while the faults sweep on, so a sweep
 * faults about once per 2 MiB (cow_impl.h: RUN_MIN_BYTES, RUN_MAX_BYTES). Apart from the event
 * handling because this is the one hot path of the handler, with its own state (the streams).
 * The page states are those of cow_pages.c.
 */
#include "cow_impl.h"

#ifdef __linux__

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
        void *copy = cow_side_alloc(s, ahead);
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
    size_t ok = k ? cow_read_live(s, local, remote, k) / s->page : 0; /* read in full, in that order */
    for (size_t i = 0; i < k; i++) {
        size_t gj = g + at[i];
        if (i < ok) {
            s->side[gj] = local[i].iov_base;
            s->state[gj] = ahead ? AHEAD : COPIED;
            continue;
        }
        cow_side_free(s, local[i].iov_base, ahead);
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
void
cow_on_fault(cow_snap *s, uintptr_t addr)
{
    size_t page = s->page;
    addr &= ~(uintptr_t)(page - 1);
    __atomic_fetch_add(&s->faults, 1, __ATOMIC_RELAXED);
    cow_range *r = cow_find_range(s, addr);
    if (!r) {
        cow_unprotect_run(s, addr, page);
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
    cow_unprotect_run(s, lo + first * page, (last - first) * page);
}

#endif
