/* cow_uffd.c: what the kernel offers a snapshot (cow.c): a userfaultfd context that sees the
 * kernel's own writes too, its features (cow_handshake) and whether live memory can be read without
 * a fault (cow_probe_safe_read). Apart from cow.c because these are probes of this kernel and
 * process, with their fallbacks, not the snapshot's life cycle.
 */
#include <stdio.h>
#include "cow_impl.h"

#ifdef __linux__

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
        cow_set_error(why, why_len, *err, "userfaultfd");
    return -1;
}

/* UFFDIO_API may be called once per context: asking for a feature the kernel lacks fails, and the
 * next try needs a new context. So a first context asks for nothing and learns what the kernel has
 * (api.features), the next asks for what is wanted of that. WP_UNPOPULATED protects never-touched
 * pages; EVENT_REMOVE tells the handler of madvise(DONTNEED/FREE) on protected memory, which drops
 * pages without a fault; EVENT_UNMAP and EVENT_REMAP of munmap and mremap (a realloc, an
 * ndarray.resize(refcheck=False)), which take them away (cow_events.c: their copy-out then fails
 * instead of reading zeros, or memory that is no longer there). */
int
cow_handshake(cow_snap *s, char *why, size_t why_len)
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
                return cow_set_error(why, why_len, EOPNOTSUPP, "userfaultfd write-protection");
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
    return cow_set_error(why, why_len, err, "UFFDIO_API");
}

/* Whether process_vm_readv on this process works here (a seccomp filter may refuse it): the live
 * pages are then read with it, which fails on memory unmapped meanwhile where memcpy would fault
 * (an munmap is reported to the handler only after the fact). */
int
cow_probe_safe_read(void)
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

#endif
