/* cow_layout.c: the memory of a snapshot (cow.c), before anything is protected: the regions are
 * checked to be private anonymous memory (cow_check_regions, from /proc/self/maps), then all of the
 * snapshot's state is laid out in one mmap'ed block (cow_layout; see cow.c's top for why not malloc),
 * the arrays' pages merged into one registration per span. Apart from cow.c because it is plain
 * bookkeeping, with no userfaultfd in it.
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
cmp_range(const void *a, const void *b)
{
    uintptr_t x = ((const cow_range *)a)->addr, y = ((const cow_range *)b)->addr;
    return x < y ? -1 : x > y;
}

/* Lay out everything in one mmap'ed block (see cow.c's top for why not malloc). */
cow_snap *
cow_layout(const uintptr_t *addrs, const size_t *sizes, size_t n, size_t page)
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
int
cow_check_regions(const uintptr_t *addrs, const size_t *sizes, size_t n, size_t page, char *why, size_t why_len)
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
        return cow_set_error(why, why_len, errno, "/proc/self/maps");
    int err = 0;
    for (size_t i = 0; !err && i < n; i++) {
        uintptr_t lo = addrs[i] / page * page, hi = (addrs[i] + sizes[i] + page - 1) / page * page;
        if (sizes[i] && !anonymous_private(maps, count, lo, hi))
            err = cow_set_error(why, why_len, EINVAL, "memory that is not private anonymous (shared or file-backed)");
    }
    free(maps);
    return err;
}

#endif
