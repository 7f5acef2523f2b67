/* cow_py.c: the Python entry points of copy-on-write snapshots (cow.c), listed in native.c's
 * method table. A snapshot is a capsule, released by its destructor at the latest. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "cow_impl.h"

#define CAPSULE "ftidask._native.cow"

static void
capsule_free(PyObject *capsule)
{
    cow_snap *s = PyCapsule_GetPointer(capsule, CAPSULE);
    if (s) {  /* nothing else holds the capsule, so no copy-out is in flight */
        cow_release(s);
        cow_free(s);
    }
}

static cow_snap *
from_capsule(PyObject *capsule)
{
    return PyCapsule_GetPointer(capsule, CAPSULE);
}

const char cow_new_doc[] =
    "cow_new(regions)\n--\n\n"
    "Write-protect the pages of every (address, nbytes) region and keep their present values\n"
    "until read out: a snapshot handle. The memory must stay mapped until cow_release.\n"
    "OSError(errno, why) when this process, kernel or memory does not allow it.";

PyObject *
cow_new_py(PyObject *module, PyObject *arg)
{
    /* A tuple of the caller's sequence: parsing an item may run Python code (__index__), which
     * could change the caller's list and free the items still to parse. */
    PyObject *seq = PySequence_Tuple(arg);
    if (!seq) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "regions must be a sequence of (address, nbytes)");
        }
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    uintptr_t *addrs = PyMem_Calloc((size_t)n + 1, sizeof(uintptr_t));
    size_t *sizes = PyMem_Calloc((size_t)n + 1, sizeof(size_t));
    PyObject *result = NULL;
    if (!addrs || !sizes) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long addr;
        Py_ssize_t size;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(seq, i), "Kn:cow_new", &addr, &size))
            goto done;
        if (size < 0) {
            PyErr_SetString(PyExc_ValueError, "nbytes must not be negative");
            goto done;
        }
        addrs[i] = (uintptr_t)addr;
        sizes[i] = (size_t)size;
    }
    cow_snap *s = NULL;
    char why[256] = "";
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = cow_create(addrs, sizes, (size_t)n, &s, why, sizeof why);
    Py_END_ALLOW_THREADS
    if (err) {
        PyObject *exc = Py_BuildValue("(is)", err, why);
        if (exc) {
            PyErr_SetObject(PyExc_OSError, exc);
            Py_DECREF(exc);
        }
        goto done;
    }
    result = PyCapsule_New(s, CAPSULE, capsule_free);
    if (!result) {
        cow_release(s);
        cow_free(s);
    }
done:
    PyMem_Free(addrs);
    PyMem_Free(sizes);
    Py_DECREF(seq);
    return result;
}

const char cow_copy_doc[] =
    "cow_copy(snapshot, index, start, out)\n--\n\n"
    "Copy bytes [start, start + len(out)) of region index, as they were at cow_new, into the\n"
    "writable buffer out; the pages read out in full are unprotected. Without the GIL. Each byte\n"
    "is read out once: a page read out in full before raises OSError(EALREADY). A page whose\n"
    "snapshot value is gone raises OSError: ENOMEM (written when no memory was left for its\n"
    "copy), ENODATA (dropped by madvise before it was read out), EFAULT (unmapped or moved by\n"
    "munmap or mremap before it was read out).";

PyObject *
cow_copy_py(PyObject *module, PyObject *args)
{
    PyObject *capsule;
    Py_ssize_t index, start;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "Onnw*:cow_copy", &capsule, &index, &start, &out))
        return NULL;
    cow_snap *s = from_capsule(capsule);
    int err = 0;
    if (s && (index < 0 || start < 0))
        err = ERANGE;
    else if (s) {
        Py_BEGIN_ALLOW_THREADS
        err = cow_copy_out(s, (size_t)index, (size_t)start, out.buf, (size_t)out.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    if (!s)
        return NULL;
    if (err == ERANGE)
        return PyErr_Format(PyExc_ValueError, "bytes [%zd, %zd) are not in region %zd", start, start + out.len, index);
    if (err) {
        const char *what = err == EBADF ? "snapshot released" : err == EALREADY ? "bytes already read out (their pages are unprotected)"
                           : err == ENOMEM ? "a page was written when no memory was left for its copy"
                           : err == ENODATA ? "a page was dropped (madvise DONTNEED or FREE) before it was read out"
                           : err == EFAULT ? "a page was unmapped, moved or made inaccessible (munmap, mremap: a realloc or "
                                             "ndarray.resize(refcheck=False); mprotect PROT_NONE) before it was read out"
                           : strerror(err);
        PyObject *exc = Py_BuildValue("(is)", err, what);
        if (exc) {
            PyErr_SetObject(PyExc_OSError, exc);
            Py_DECREF(exc);
        }
        return NULL;
    }
    Py_RETURN_NONE;
}

const char cow_release_doc[] =
    "cow_release(snapshot)\n--\n\n"
    "Unprotect and unregister everything and free the side copies (waits for copy-outs in\n"
    "flight). Idempotent.";

PyObject *
cow_release_py(PyObject *module, PyObject *arg)
{
    cow_snap *s = from_capsule(arg);
    if (!s)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    cow_release(s);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

const char cow_stats_doc[] =
    "cow_stats(snapshot)\n--\n\n"
    "A dict: pages_copied, pages_copied_ahead (of those, copied by the run around a faulting page,\n"
    "not for the page written), pages_lost (written without memory, or dropped), faults (write faults handled), peak_bytes (of side\n"
    "copies at once), live_bytes, pages, ranges (registrations), unpopulated_protected,\n"
    "drops_reported (pages madvise drops fail their copy-out; else they read as zeros),\n"
    "unmaps_reported (the handler hears of munmap and mremap), safe_read (live pages are read\n"
    "with process_vm_readv: an unmapped one fails its copy-out, never faults).";

PyObject *
cow_stats_py(PyObject *module, PyObject *arg)
{
    cow_snap *s = from_capsule(arg);
    if (!s)
        return NULL;
    cow_stat st;
    cow_stats(s, &st);
    int unmaps = 0, safe = 0;
#ifdef __linux__
    unmaps = s->unmap_events;
    safe = s->safe_read;
#endif
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:O,s:O,s:O,s:O}", "pages_copied", (Py_ssize_t)st.pages_copied,
                         "pages_copied_ahead", (Py_ssize_t)st.pages_copied_ahead, "pages_lost", (Py_ssize_t)st.pages_lost,
                         "faults", (Py_ssize_t)st.faults, "peak_bytes", (Py_ssize_t)st.peak_bytes, "live_bytes",
                         (Py_ssize_t)st.live_bytes, "pages", (Py_ssize_t)st.pages, "ranges", (Py_ssize_t)st.ranges,
                         "unpopulated_protected", st.unpopulated_protected ? Py_True : Py_False, "drops_reported",
                         st.drops_reported ? Py_True : Py_False, "unmaps_reported", unmaps ? Py_True : Py_False,
                         "safe_read", safe ? Py_True : Py_False);
}

const char cow_probe_doc[] =
    "cow_probe()\n--\n\n"
    "(True, '') when this process can take copy-on-write snapshots, else (False, why): one page\n"
    "of fresh memory is protected and released.";

PyObject *
cow_probe_py(PyObject *module, PyObject *unused)
{
    char why[256] = "";
    int err = ENOSYS;
#ifdef __linux__
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    void *mem = mmap(NULL, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED)
        return Py_BuildValue("(Os)", Py_False, "mmap failed");
    uintptr_t addr = (uintptr_t)mem;
    cow_snap *s = NULL;
    Py_BEGIN_ALLOW_THREADS
    err = cow_create(&addr, &page, 1, &s, why, sizeof why);
    if (!err) {
        cow_release(s);
        cow_free(s);
    }
    Py_END_ALLOW_THREADS
    munmap(mem, page);
#else
    snprintf(why, sizeof why, "copy-on-write snapshots need Linux's userfaultfd");
#endif
    return Py_BuildValue("(Os)", err ? Py_False : Py_True, why);
}
