/* cow_copyout.c: the copy-out of a snapshot (cow_copy_out, the background reader): each page is
 * taken from its side copy if there is one, else from memory (still protected, so unchanged), and
 * the pages read in full are unprotected, so that later writes to them cost nothing. Apart from the
 * handler thread's files (cow_fault.c, cow_events.c) because it runs in the caller's thread, and
 * must never wait on a handler that waits on it (see the bounce buffer in cow_copy_out).
 * The page states are those of cow_pages.c.
 */
#include "cow_impl.h"

#ifdef __linux__

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
        cow_side_free(s, s->side[g], st == AHEAD);
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
 * reads their event and before mark_range (cow_events.c) marks them (the remove_seq window): a
 * piece counts only if no such window was open at any time of its read (remove_seq even before and
 * after, event_gen unchanged); else -EAGAIN, and the caller waits for the window to close (this chunk's lock
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
        size_t got = cow_read_live(s, &local, &remote, 1);
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

#else /* not Linux: cow.c refuses to create a snapshot, so this is never reached */

int cow_copy_out(cow_snap *s, size_t j, size_t start, char *out, size_t n) { return ENOSYS; }

#endif
