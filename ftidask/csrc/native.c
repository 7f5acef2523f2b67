/* ftidask._native: the two system-level helpers of the checkpoint write path, and the module's
 * method table for the helpers of the other files.
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
 * start_writeback: start the write-back of a range of a file as soon as it is written.
 *
 * populate_write: fault in the pages of an array a recovery is about to fill, without changing a
 * byte (native_pages.c).
 *
 * page_map, page_move, page_unmap: private pages a recovery fills and verifies, then moves under an
 * array (native_pages.c).
 *
 * gf_matmul, gf_set_isa, gf_isa: the GF(2^8) kernel of the level-3 Reed-Solomon codec (gf256.c), with
 * the GIL released (native_gf.c).
 *
 * cow_*: copy-on-write memory snapshots for asynchronous checkpoints (cow.c, Linux userfaultfd;
 * Python entry points in cow_py.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <errno.h>
#ifdef __linux__
#include <fcntl.h>
#endif

#define XXH_STATIC_LINKING_ONLY
#define XXH_INLINE_ALL
#include "xxhash.h"
#include "gf256.h"
#include "cow.h"
#include "native.h"

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

static PyMethodDef methods[] = {
    {"xxh3_blocks", xxh3_blocks, METH_VARARGS, xxh3_blocks_doc},
    {"start_writeback", start_writeback, METH_VARARGS, start_writeback_doc},
    {"populate_write", populate_write_py, METH_O, populate_write_doc},
    {"page_map", page_map_py, METH_VARARGS, page_map_doc},
    {"page_move", page_move_py, METH_VARARGS, page_move_doc},
    {"page_unmap", page_unmap_py, METH_VARARGS, page_unmap_doc},
    {"gf_matmul", (PyCFunction)(void (*)(void))gf_matmul_py, METH_VARARGS | METH_KEYWORDS, gf_matmul_doc},
    {"gf_set_isa", gf_set_isa_py, METH_O, gf_set_isa_doc},
    {"gf_isa", gf_isa_py, METH_NOARGS, gf_isa_doc},
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
