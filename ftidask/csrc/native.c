/* ftidask._native: the two system-level helpers of the checkpoint write path.
 *
 * xxh3_blocks: XXH3 digests of every block of a buffer, in one call, without the GIL.
 * Differential checkpointing hashes the whole state in blocks of at most 64 KiB (FTI's bound).
 * The xxhash binding holds the GIL for inputs of 64 KiB or less, so one call per block from
 * Python threads runs on one core at a time, and the per-call overhead is a sizeable share of
 * the cost. Here one call hashes a whole segment, block by block, with the GIL released, so the
 * segments of a thread pool are hashed on every core. On x86-64 the XXH3 code is picked at run
 * time (SSE2, AVX2 or AVX-512) by xxHash's own dispatcher (vendored, unmodified, in xxhash/).
 *
 * The digests are the canonical (big-endian) forms, byte for byte those of
 * xxhash.xxh3_128_digest / xxhash.xxh3_64_digest, which readers use: this module only speeds up
 * the writer and the verifier, it never changes what the file holds.
 *
 * populate_write: fault in the pages of an array a recovery is about to fill, without changing a byte.
 *
 * page_map, page_move, page_unmap: private pages a recovery fills and verifies, then moves under an array.
 *
 * gf_matmul: the GF(2^8) kernel of the level-3 Reed-Solomon codec (gf256.c), with the GIL released.
 *
 * cow_*: copy-on-write memory snapshots for asynchronous checkpoints (cow.c, Linux userfaultfd).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <errno.h>
#ifdef __linux__
#include <fcntl.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h> /* mremap's MREMAP_FIXED: Python.h defines _GNU_SOURCE */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older kernels answer EINVAL */
#endif
#endif

#define XXH_STATIC_LINKING_ONLY
#define XXH_INLINE_ALL
#include "xxhash.h"
#include "gf256.h"
#include "cow.h"

#ifdef FTIDASK_XXH_DISPATCH
#define XXH_DISPATCH_DISABLE_REPLACE
#include "xxh_x86dispatch.h"
#define HASH128 XXH3_128bits_dispatch
#define HASH64 XXH3_64bits_dispatch
#else
#define HASH128 XXH3_128bits
#define HASH64 XXH3_64bits
#endif

static void
hash_blocks(const unsigned char *data, Py_ssize_t len, Py_ssize_t block, int width, unsigned char *out)
{
    for (Py_ssize_t lo = 0; lo < len; lo += block, out += width) {
        size_t n = (size_t)(len - lo < block ? len - lo : block);
        if (width == 16) {
            XXH128_canonical_t c;
            XXH128_canonicalFromHash(&c, HASH128(data + lo, n));
            memcpy(out, c.digest, 16);
        } else {
            XXH64_canonical_t c;
            XXH64_canonicalFromHash(&c, HASH64(data + lo, n));
            memcpy(out, c.digest, 8);
        }
    }
}

PyDoc_STRVAR(xxh3_blocks_doc,
"xxh3_blocks(data, block_size, out, width)\n--\n\n"
"Write the XXH3 digest (width 16: XXH3-128, width 8: XXH3-64) of each block_size-byte block\n"
"of data (the last one may be shorter) into the writable buffer out, which holds exactly\n"
"ceil(len(data) / block_size) * width bytes. The GIL is released while hashing.");

static PyObject *
xxh3_blocks(PyObject *module, PyObject *args)
{
    Py_buffer data, out;
    Py_ssize_t block;
    int width;
    if (!PyArg_ParseTuple(args, "y*nw*i:xxh3_blocks", &data, &block, &out, &width))
        return NULL;
    PyObject *result = NULL;
    if (block <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
    } else if (block > PY_SSIZE_T_MAX / 2) {
        /* data.len + block - 1 below would overflow (no buffer is that long: one block is all) */
        PyErr_Format(PyExc_ValueError, "block_size must be at most %zd, got %zd", PY_SSIZE_T_MAX / 2, block);
    } else if (width != 16 && width != 8) {
        PyErr_SetString(PyExc_ValueError, "width must be 16 (XXH3-128) or 8 (XXH3-64)");
    } else if (out.len != (data.len + block - 1) / block * width) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, %zd blocks of %d bytes need %zd", out.len,
                     (data.len + block - 1) / block, width, (data.len + block - 1) / block * width);
    } else {
        Py_BEGIN_ALLOW_THREADS
        hash_blocks((const unsigned char *)data.buf, data.len, block, width, (unsigned char *)out.buf);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

/* start_writeback: a checkpoint ends with fsync, which waits for every dirty page of the file.
 * Asking the kernel to start writing a range as soon as it is written (what databases do with
 * "bytes per sync") overlaps that I/O with the hashing and writing still to come, so the final
 * fsync waits for the tail only. It does not wait and guarantees nothing: durability is still
 * the fsync's job. A no-op where sync_file_range does not exist. */
PyDoc_STRVAR(start_writeback_doc,
"start_writeback(fd, offset, nbytes)\n--\n\n"
"Start (do not wait for) the write-back of bytes [offset, offset + nbytes) of file fd.\n"
"Returns True if the kernel was asked, False where this is not supported.");

static PyObject *
start_writeback(PyObject *module, PyObject *args)
{
    int fd;
    long long offset, nbytes;
    if (!PyArg_ParseTuple(args, "iLL:start_writeback", &fd, &offset, &nbytes))
        return NULL;
    if (offset < 0 || nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "offset and nbytes must not be negative");
        return NULL;
    }
#if defined(__linux__) && defined(SYNC_FILE_RANGE_WRITE)
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = sync_file_range(fd, (off_t)offset, (off_t)nbytes, SYNC_FILE_RANGE_WRITE);
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}


/* populate_write: a restart fills arrays that are usually fresh (np.empty, np.zeros: no page yet), and
 * the first write to each page costs a fault and the zeroing of a page. A recovery first verifies the
 * whole file, waiting on the disk with a core to spare: faulting the pages in then (MADV_POPULATE_WRITE
 * preserves the contents, so a refused recovery still leaves the array as it was) takes that cost off
 * the copy that follows verification. Only the whole pages inside the buffer are touched. */
PyDoc_STRVAR(populate_write_doc,
"populate_write(buffer)\n--\n\n"
"Fault in, writable, the whole pages inside the writable contiguous buffer, keeping its bytes.\n"
"The GIL is released. Returns True if the kernel did it, False where it cannot (old kernel,\n"
"not Linux, a mapping that refuses it): a hint only, nothing depends on it.");

static PyObject *
populate_write(PyObject *module, PyObject *arg)
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

PyDoc_STRVAR(page_map_doc,
"page_map(nbytes, like)\n--\n\n"
"Map nbytes (whole pages) of private anonymous memory at an address congruent to like modulo 2 MiB\n"
"(so that transparent huge pages can move whole); returns the address. OSError if the kernel refuses.");

static PyObject *
page_map(PyObject *module, PyObject *args)
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

PyDoc_STRVAR(page_move_doc,
"page_move(src, dst, nbytes)\n--\n\n"
"Move the pages [src, src + nbytes) of one private anonymous mapping to dst, replacing what was\n"
"mapped there (mremap). True when done (src is then unmapped); False, changing nothing, if refused.");

static PyObject *
page_move(PyObject *module, PyObject *args)
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

PyDoc_STRVAR(page_unmap_doc, "page_unmap(addr, nbytes)\n--\n\nUnmap what page_map mapped (or what is left of it).");

static PyObject *
page_unmap(PyObject *module, PyObject *args)
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


/* gf_matmul: argument checks here (with the GIL), arithmetic in gf256.c (without it). */
PyDoc_STRVAR(gf_matmul_doc,
"gf_matmul(matrix, inputs, outputs, accumulate=False)\n--\n\n"
"outputs[i] = XOR_j matrix[i*k + j] * inputs[j] in GF(2^8) (polynomial 0x11D), byte by byte;\n"
"with accumulate, outputs[i] ^= that. k = len(inputs), m = len(outputs) (each at most 256);\n"
"matrix is m*k bytes, row by row. Every buffer is contiguous and of one length; outputs are\n"
"writable and overlap no other buffer, the matrix included. The GIL is released while computing.");

static int
get_buffers(PyObject *seq, Py_buffer *views, Py_ssize_t count, int writable, const char *what)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i);
        if (PyObject_GetBuffer(item, &views[i], writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) == 0)
            continue;
        if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_TypeError) ||
            PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyErr_Clear(); /* one message for "not a buffer", "read-only" and "not contiguous" */
            PyErr_Format(PyExc_TypeError, "%s[%zd] must be a %scontiguous bytes-like object, got %.80s", what, i,
                         writable ? "writable, " : "", Py_TYPE(item)->tp_name);
        }
        for (Py_ssize_t j = 0; j < i; j++)
            PyBuffer_Release(&views[j]);
        return -1;
    }
    return 0;
}

static int
overlap(const Py_buffer *a, const Py_buffer *b)
{
    const char *pa = a->buf, *pb = b->buf;
    return a->len > 0 && b->len > 0 && pa < pb + b->len && pb < pa + a->len;
}

/* A tuple of the caller's sequence: the caller's own list (what PySequence_Fast hands back) may be
 * changed by another thread while the kernel runs without the GIL, and the buffers taken from it
 * must be released by the count taken. */
static PyObject *
as_tuple(PyObject *seq, const char *message)
{
    PyObject *tuple = PySequence_Tuple(seq);
    if (!tuple && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, message);
    }
    return tuple;
}

static PyObject *
gf_matmul_py(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"matrix", "inputs", "outputs", "accumulate", NULL};
    Py_buffer mat;
    PyObject *ins_arg, *outs_arg, *ins = NULL, *outs = NULL, *result = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t k = 0, m = 0;
    int accumulate = 0, have_in = 0, have_out = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*OO|p:gf_matmul", kwlist, &mat, &ins_arg, &outs_arg,
                                     &accumulate))
        return NULL;
    ins = as_tuple(ins_arg, "inputs must be a sequence of buffers");
    outs = ins ? as_tuple(outs_arg, "outputs must be a sequence of writable buffers") : NULL;
    if (!outs)
        goto done;
    k = PyTuple_GET_SIZE(ins);
    m = PyTuple_GET_SIZE(outs);
    if (k > GF_MAX_ROWS || m > GF_MAX_ROWS) {
        PyErr_Format(PyExc_ValueError, "at most %d inputs and %d outputs, got %zd and %zd", GF_MAX_ROWS,
                     GF_MAX_ROWS, k, m);
        goto done;
    }
    if (mat.len != m * k) {
        PyErr_Format(PyExc_ValueError, "matrix holds %zd bytes, %zd outputs x %zd inputs need %zd", mat.len, m, k,
                     m * k);
        goto done;
    }
    views = PyMem_Calloc((size_t)(k + m) + 1, sizeof(Py_buffer));
    if (!views) {
        PyErr_NoMemory();
        goto done;
    }
    if (get_buffers(ins, views, k, 0, "inputs") < 0)
        goto done;
    have_in = 1;
    if (get_buffers(outs, views + k, m, 1, "outputs") < 0)
        goto done;
    have_out = 1;
    Py_ssize_t n = k + m > 0 ? views[0].len : 0;
    for (Py_ssize_t i = 0; i < k + m; i++)
        if (views[i].len != n) {
            PyErr_Format(PyExc_ValueError, "every buffer must hold %zd bytes, %s[%zd] holds %zd", n,
                         i < k ? "inputs" : "outputs", i < k ? i : i - k, views[i].len);
            goto done;
        }
    /* An output overlapping any other buffer would be read after writes: the matrix too (the
     * kernels read it again after the first row is written). */
    for (Py_ssize_t i = k; i < k + m; i++) {
        if (overlap(&views[i], &mat)) {
            PyErr_Format(PyExc_ValueError, "outputs[%zd] overlaps the matrix", i - k);
            goto done;
        }
        for (Py_ssize_t j = 0; j < k + m; j++)
            if (j != i && overlap(&views[i], &views[j])) {
                PyErr_Format(PyExc_ValueError, "outputs[%zd] overlaps %s[%zd]", i - k, j < k ? "inputs" : "outputs",
                             j < k ? j : j - k);
                goto done;
            }
    }
    {
        const uint8_t **in_p = PyMem_Malloc(sizeof(void *) * (size_t)(k + m + 1));
        if (!in_p) {
            PyErr_NoMemory();
            goto done;
        }
        uint8_t **out_p = (uint8_t **)(in_p + k);
        for (Py_ssize_t i = 0; i < k; i++)
            in_p[i] = views[i].buf;
        for (Py_ssize_t i = 0; i < m; i++)
            out_p[i] = views[k + i].buf;
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = gf_matmul(mat.buf, (int)m, (int)k, in_p, out_p, (size_t)n, accumulate);
        Py_END_ALLOW_THREADS
        PyMem_Free(in_p);
        result = rc == 0 ? Py_NewRef(Py_None) : PyErr_NoMemory();
    }
done:
    if (views) {
        for (Py_ssize_t i = 0; have_in && i < k; i++)
            PyBuffer_Release(&views[i]);
        for (Py_ssize_t i = 0; have_out && i < m; i++)
            PyBuffer_Release(&views[k + i]);
        PyMem_Free(views);
    }
    Py_XDECREF(ins);
    Py_XDECREF(outs);
    PyBuffer_Release(&mat);
    return result;
}

PyDoc_STRVAR(gf_set_isa_doc,
"gf_set_isa(name)\n--\n\n"
"Use the gf_matmul code path name (\"auto\": the best this CPU has; \"scalar\", \"ssse3\", \"avx2\",\n"
"\"gfni-avx2\", \"avx512\", \"gfni\", \"neon\"). Returns False, changing nothing, when the CPU or\n"
"this build lacks it; ValueError for an unknown name. A test seam: every path gives the same bytes.");

static PyObject *
gf_set_isa(PyObject *module, PyObject *arg)
{
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (!name) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "gf_set_isa takes a str");
        return NULL;
    }
    int rc = gf_select(name);
    if (rc < 0)
        return PyErr_Format(PyExc_ValueError, "unknown GF(2^8) code path %R", arg);
    return PyBool_FromLong(rc);
}

PyDoc_STRVAR(gf_isa_doc, "gf_isa()\n--\n\nThe name of the code path gf_matmul uses.");

static PyObject *
gf_isa(PyObject *module, PyObject *unused)
{
    return PyUnicode_FromString(gf_isa_name());
}

static PyMethodDef methods[] = {
    {"xxh3_blocks", xxh3_blocks, METH_VARARGS, xxh3_blocks_doc},
    {"start_writeback", start_writeback, METH_VARARGS, start_writeback_doc},
    {"populate_write", populate_write, METH_O, populate_write_doc},
    {"page_map", page_map, METH_VARARGS, page_map_doc},
    {"page_move", page_move, METH_VARARGS, page_move_doc},
    {"page_unmap", page_unmap, METH_VARARGS, page_unmap_doc},
    {"gf_matmul", (PyCFunction)(void (*)(void))gf_matmul_py, METH_VARARGS | METH_KEYWORDS, gf_matmul_doc},
    {"gf_set_isa", gf_set_isa, METH_O, gf_set_isa_doc},
    {"gf_isa", gf_isa, METH_NOARGS, gf_isa_doc},
    {"cow_probe", cow_probe_py, METH_NOARGS, cow_probe_doc},
    {"cow_new", cow_new_py, METH_O, cow_new_doc},
    {"cow_copy", cow_copy_py, METH_VARARGS, cow_copy_doc},
    {"cow_release", cow_release_py, METH_O, cow_release_doc},
    {"cow_stats", cow_stats_py, METH_O, cow_stats_doc},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot slots[] = {
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#ifdef Py_GIL_DISABLED
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ftidask._native",
    "XXH3 block digests and GF(2^8) stripes without the GIL, early write-back, copy-on-write snapshots.", 0, methods, slots,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    gf_init(); /* idempotent: a second interpreter rebuilds the same table */
    gf_select("auto");
    return PyModuleDef_Init(&module);
}
