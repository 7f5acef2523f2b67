/* native_pages.c: the page helpers of a recovery in ftidask._native (its method table: native.c):
 * populate_write faults in the pages of an array a recovery is about to fill, without changing a
 * byte; page_map, page_move and page_unmap stage private pages that a recovery fills and verifies,
 * then moves under an array. Apart from native.c because they are the recovery's memory calls
 * (madvise, mmap, mremap), not the write path's hashing and write-back.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#ifdef __linux__
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h> /* mremap's MREMAP_FIXED: Python.h defines _GNU_SOURCE */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older kernels answer EINVAL */
#endif
#endif

#include "native.h"

/* populate_write: a restart fills arrays that are usually fresh (np.empty, np.zeros: no page yet), and
 * the first write to each page costs a fault and the zeroing of a page. A recovery first verifies the
 * whole file, waiting on the disk with a core to spare: faulting the pages in then (MADV_POPULATE_WRITE
 * preserves the contents, so a refused recovery still leaves the array as it was) takes that cost off
 * the copy that follows verification. Only the whole pages inside the buffer are touched. */
const char populate_write_doc[] = PyDoc_STR(
"populate_write(buffer)\n--\n\n"
"Fault in, writable, the whole pages inside the writable contiguous buffer, keeping its bytes.\n"
"The GIL is released. Returns True if the kernel did it, False where it cannot (old kernel,\n"
"not Linux, a mapping that refuses it): a hint only, nothing depends on it.");

PyObject *
populate_write_py(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_WRITABLE) < 0)
        return NULL;
    int rc = -1;
#ifdef __linux__
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = ((uintptr_t)view.buf + page - 1) & ~(page - 1);
    uintptr_t hi = ((uintptr_t)view.buf + (uintptr_t)view.len) & ~(page - 1);
    if (hi > lo) {
        Py_BEGIN_ALLOW_THREADS
        rc = madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE);
        Py_END_ALLOW_THREADS
    }
#endif
    PyBuffer_Release(&view);
    return PyBool_FromLong(rc == 0);
}


/* Staged pages. A restart's arrays are fresh: none of their pages was ever touched. A verified recovery
 * into them reads the file into private pages of its own (page_map) while it hashes it, and once every
 * hash matched (and every rank agreed) moves those pages under the array (page_move: mremap, a change of
 * page tables): no byte is copied after verification, and the array never holds an unverified byte.
 * Addresses are plain integers: the caller (ftidask/engine/pagemove.py) owns what it maps. */
#define HUGE_ALIGN ((uintptr_t)2 << 20)

static int
page_aligned(uintptr_t value)
{
    return value % (uintptr_t)sysconf(_SC_PAGESIZE) == 0;
}

const char page_map_doc[] = PyDoc_STR(
"page_map(nbytes, like)\n--\n\n"
"Map nbytes (whole pages) of private anonymous memory at an address congruent to like modulo 2 MiB\n"
"(so that transparent huge pages can move whole); returns the address. OSError if the kernel refuses.");

PyObject *
page_map_py(PyObject *module, PyObject *args)
{
    unsigned long long nbytes, like;
    if (!PyArg_ParseTuple(args, "KK:page_map", &nbytes, &like))
        return NULL;
#ifdef __linux__
    if (nbytes == 0 || !page_aligned((uintptr_t)nbytes) || !page_aligned((uintptr_t)like)) {
        PyErr_SetString(PyExc_ValueError, "page_map takes a positive whole number of pages and a page address");
        return NULL;
    }
    if (nbytes > (unsigned long long)(PTRDIFF_MAX - HUGE_ALIGN)) { /* + HUGE_ALIGN below would wrap */
        errno = ENOMEM;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    size_t total = (size_t)nbytes + HUGE_ALIGN;
    void *raw = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        return PyErr_SetFromErrno(PyExc_OSError);
    uintptr_t start = (uintptr_t)raw, base = start + (((uintptr_t)like - start) % HUGE_ALIGN);
    if (base > start)
        munmap(raw, base - start);
    if (start + total > base + nbytes)
        munmap((void *)(base + nbytes), start + total - (base + nbytes));
    madvise((void *)base, nbytes, MADV_HUGEPAGE); /* as NumPy advises its large arrays; a hint */
    return PyLong_FromUnsignedLongLong((unsigned long long)base);
#else
    PyErr_SetString(PyExc_OSError, "page_map needs Linux");
    return NULL;
#endif
}

const char page_move_doc[] = PyDoc_STR(
"page_move(src, dst, nbytes)\n--\n\n"
"Move the pages [src, src + nbytes) of one private anonymous mapping to dst, replacing what was\n"
"mapped there (mremap). True when done (src is then unmapped); False, changing nothing, if refused.");

PyObject *
page_move_py(PyObject *module, PyObject *args)
{
    unsigned long long src, dst, nbytes;
    if (!PyArg_ParseTuple(args, "KKK:page_move", &src, &dst, &nbytes))
        return NULL;
#if defined(__linux__) && defined(MREMAP_FIXED)
    if (nbytes == 0 || !page_aligned((uintptr_t)src) || !page_aligned((uintptr_t)dst) ||
        !page_aligned((uintptr_t)nbytes)) {
        PyErr_SetString(PyExc_ValueError, "page_move takes page addresses and a whole number of pages");
        return NULL;
    }
    void *got;
    Py_BEGIN_ALLOW_THREADS
    got = mremap((void *)(uintptr_t)src, (size_t)nbytes, (size_t)nbytes, MREMAP_MAYMOVE | MREMAP_FIXED,
                 (void *)(uintptr_t)dst);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(got == (void *)(uintptr_t)dst);
#else
    Py_RETURN_FALSE;
#endif
}

const char page_unmap_doc[] = PyDoc_STR("page_unmap(addr, nbytes)\n--\n\nUnmap what page_map mapped (or what is left of it).");

PyObject *
page_unmap_py(PyObject *module, PyObject *args)
{
    unsigned long long addr, nbytes;
    if (!PyArg_ParseTuple(args, "KK:page_unmap", &addr, &nbytes))
        return NULL;
#ifdef __linux__
    if (nbytes && munmap((void *)(uintptr_t)addr, (size_t)nbytes) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
#endif
    Py_RETURN_NONE;
}
