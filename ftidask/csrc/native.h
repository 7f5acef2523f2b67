/* native.h: the Python entry points of ftidask._native defined outside native.c, for its method
 * table: the recovery's page helpers (native_pages.c) and the GF(2^8) kernel's (native_gf.c). The
 * copy-on-write snapshots' are in cow.h. Include after Python.h. */
#ifndef FTIDASK_NATIVE_H
#define FTIDASK_NATIVE_H

/* native_pages.c */
extern const char populate_write_doc[], page_map_doc[], page_move_doc[], page_unmap_doc[];
PyObject *populate_write_py(PyObject *module, PyObject *arg);
PyObject *page_map_py(PyObject *module, PyObject *args);
PyObject *page_move_py(PyObject *module, PyObject *args);
PyObject *page_unmap_py(PyObject *module, PyObject *args);

/* native_gf.c */
extern const char gf_matmul_doc[], gf_set_isa_doc[], gf_isa_doc[];
PyObject *gf_matmul_py(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *gf_set_isa_py(PyObject *module, PyObject *arg);
PyObject *gf_isa_py(PyObject *module, PyObject *unused);

#endif
