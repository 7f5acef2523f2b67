/* cow.h: copy-on-write memory snapshots (cow.c; cow_copy_out in cow_copyout.c, cow_stats in
 * cow_pages.c), and their Python entry points (cow_py.c) for native.c's method table. */
#ifndef FTIDASK_COW_H
#define FTIDASK_COW_H

#include <stddef.h>
#include <stdint.h>

typedef struct cow_snap cow_snap;

typedef struct {
    size_t pages_copied, pages_copied_ahead, pages_lost, faults, peak_bytes, live_bytes, pages, ranges;
    int unpopulated_protected, drops_reported;
} cow_stat;

/* 0, or an errno with a sentence in why. */
int cow_create(const uintptr_t *addrs, const size_t *sizes, size_t n, cow_snap **out, char *why, size_t why_len);
int cow_copy_out(cow_snap *s, size_t j, size_t start, char *out, size_t n);
void cow_release(cow_snap *s);
void cow_free(cow_snap *s);
void cow_stats(cow_snap *s, cow_stat *st);

#ifdef Py_PYTHON_H
extern const char cow_probe_doc[], cow_new_doc[], cow_copy_doc[], cow_release_doc[], cow_stats_doc[];
PyObject *cow_probe_py(PyObject *module, PyObject *unused);
PyObject *cow_new_py(PyObject *module, PyObject *arg);
PyObject *cow_copy_py(PyObject *module, PyObject *args);
PyObject *cow_release_py(PyObject *module, PyObject *arg);
PyObject *cow_stats_py(PyObject *module, PyObject *arg);
#endif

#endif
