/* native_gf.c: the Python entry points of the GF(2^8) kernel (gf256.c) in ftidask._native (its
 * method table: native.c): gf_matmul, with its argument checks here (with the GIL) and the
 * arithmetic in gf256.c (without it), and the choice of code path (gf_set_isa, gf_isa). Apart from
 * native.c because the checks of a matrix and its buffers are most of this code, and the level-3
 * codec (ftidask/levels/gf_native.py) its only user.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "gf256.h"
#include "native.h"

/* gf_matmul: argument checks here (with the GIL), arithmetic in gf256.c (without it). */
const char gf_matmul_doc[] = PyDoc_STR(
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

PyObject *
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

const char gf_set_isa_doc[] = PyDoc_STR(
"gf_set_isa(name)\n--\n\n"
"Use the gf_matmul code path name (\"auto\": the best this CPU has; \"scalar\", \"ssse3\", \"avx2\",\n"
"\"gfni-avx2\", \"avx512\", \"gfni\", \"neon\"). Returns False, changing nothing, when the CPU or\n"
"this build lacks it; ValueError for an unknown name. A test seam: every path gives the same bytes.");

PyObject *
gf_set_isa_py(PyObject *module, PyObject *arg)
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

const char gf_isa_doc[] = PyDoc_STR("gf_isa()\n--\n\nThe name of the code path gf_matmul uses.");

PyObject *
gf_isa_py(PyObject *module, PyObject *unused)
{
    return PyUnicode_FromString(gf_isa_name());
}
