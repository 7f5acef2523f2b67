/* cow_pages.c: the page states of a snapshot (cow.c), and the page-level primitives that the write
 * faults (cow_fault.c), the userfaultfd events (cow_events.c) and the copy-out (cow_copyout.c) share:
 * write-protection, reads of live memory, the range lookup, the side-page allocator and its counters
 * (cow_stats). Kept apart so that each of those files holds one path, and these live in one place.
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
size_t
cow_read_live(cow_snap *s, const struct iovec *local, const struct iovec *remote, size_t n)
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

/* A side page: never malloc, which may write to protected heap pages (see cow.c's top). */
void *
cow_side_alloc(cow_snap *s, int ahead)
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

/* A side page back to the free list: read out (cow_copyout.c), or unread (cow_fault.c). */
void
cow_side_free(cow_snap *s, void *p, int ahead)
{
    pthread_mutex_lock(&s->alloc_lock);
    *(void **)p = s->free_list;
    s->free_list = p;
    s->live--;
    s->ahead_live -= ahead != 0;
    pthread_mutex_unlock(&s->alloc_lock);
}

/* The counters, under alloc_lock: kept by the allocator above, and by the handler for the pages it
 * marks lost (cow_fault.c, cow_events.c). */
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

#else /* not Linux: cow.c refuses to create a snapshot, so this is never reached */

void cow_stats(cow_snap *s, cow_stat *st) { memset(st, 0, sizeof *st); }

#endif
