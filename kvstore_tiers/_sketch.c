/* The frequency sketch's per-key work, compiled: kvstore_tiers/admission.py.
 *
 * Called once per store or load job on vLLM's scheduler thread; the Python
 * twins in admission.py (_offer_py, _increment_py) do exactly the same and a
 * test checks that both agree, key by key.
 *
 * Table: ROWS rows of `width` one-byte counters, row-major, in a bytearray.
 * A key is a bytes object of at least 16 bytes (vLLM's 32-byte block hash and
 * a 4-byte group index); its row-r index is bytes [4r, 4r+4) read little
 * endian, XORed with a mix of bytes [32, 36) (the group index) so that
 * groups of one block count apart, masked to the width. The block hash is
 * uniform already, so slicing it is the hash.
 *
 * Conservative update: only the row counters equal to the key's minimum are
 * incremented, saturating at MAX_COUNT.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ROWS 4
#define MAX_COUNT 15

static uint32_t load_u32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

/* The key's group mix: the bytes past the 32-byte hash, read as one u32,
 * through murmur3's finaliser so that every bit of it reaches the low bits. */
static uint32_t group_of(const unsigned char *p, Py_ssize_t n) {
    uint32_t g = 0;
    for (Py_ssize_t i = 32; i < n && i < 36; i++) g |= (uint32_t)p[i] << (8 * (i - 32));
    g ^= g >> 16;
    g *= 0x85EBCA6Bu;
    g ^= g >> 13;
    g *= 0xC2B2AE35u;
    g ^= g >> 16;
    return g;
}

/* Increment `key` (conservatively) and return its estimate after; -1 on error. */
static int bump(unsigned char *table, Py_ssize_t width, uint32_t mask, PyObject *key) {
    if (!PyBytes_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "sketch keys must be bytes");
        return -1;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(key);
    if (n < 4 * ROWS) {
        PyErr_SetString(PyExc_ValueError, "sketch keys must be at least 16 bytes");
        return -1;
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(key);
    uint32_t g = group_of(p, n);
    unsigned char *c[ROWS];
    unsigned char m = 255;
    for (int r = 0; r < ROWS; r++) {
        c[r] = table + (Py_ssize_t)r * width + ((load_u32(p + 4 * r) ^ g) & mask);
        if (*c[r] < m) m = *c[r];
    }
    if (m >= MAX_COUNT) return MAX_COUNT;
    for (int r = 0; r < ROWS; r++)
        if (*c[r] == m) *c[r] = (unsigned char)(m + 1);
    return m + 1;
}

/* The table (a writable buffer of ROWS rows) and its mask (width - 1). */
static int parse_table(PyObject *table, PyObject *mask_obj, Py_buffer *buf, uint32_t *mask,
                       Py_ssize_t *width) {
    unsigned long m = PyLong_AsUnsignedLong(mask_obj);
    if (m == (unsigned long)-1 && PyErr_Occurred()) return -1;
    if (PyObject_GetBuffer(table, buf, PyBUF_WRITABLE) < 0) return -1;
    *width = (Py_ssize_t)m + 1;
    if (m > 0xFFFFFFFFul || (*width & (*width - 1)) || buf->len != ROWS * *width) {
        PyBuffer_Release(buf);
        PyErr_SetString(PyExc_ValueError, "table must be 4 rows of mask + 1 (a power of two)");
        return -1;
    }
    *mask = (uint32_t)m;
    return 0;
}

/* (table, keys: list, mask, ...) */
static int parse(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, Py_buffer *buf,
                 uint32_t *mask, Py_ssize_t *width) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments", want);
        return -1;
    }
    if (!PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "keys must be a list");
        return -1;
    }
    return parse_table(args[0], args[2], buf, mask, width);
}

/* offer(table, keys, mask, threshold) -> None | list[int]
 * Count one sighting of every key; None if every key's estimate reached
 * `threshold`, else the indices (ascending) of those that did. */
static PyObject *offer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer buf;
    uint32_t mask;
    Py_ssize_t width;
    if (parse(args, nargs, 4, &buf, &mask, &width) < 0) return NULL;
    long threshold = PyLong_AsLong(args[3]);
    if (threshold == -1 && PyErr_Occurred()) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    PyObject *keys = args[1];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *admitted = NULL; /* made at the first key that falls short */
    for (Py_ssize_t i = 0; i < n; i++) {
        int est = bump((unsigned char *)buf.buf, width, mask, PyList_GET_ITEM(keys, i));
        if (est < 0) goto error;
        if (est >= threshold) {
            if (admitted != NULL) {
                PyObject *idx = PyLong_FromSsize_t(i);
                if (idx == NULL || PyList_Append(admitted, idx) < 0) {
                    Py_XDECREF(idx);
                    goto error;
                }
                Py_DECREF(idx);
            }
        } else if (admitted == NULL) {
            admitted = PyList_New(i);
            if (admitted == NULL) goto error;
            for (Py_ssize_t j = 0; j < i; j++) {
                PyObject *idx = PyLong_FromSsize_t(j);
                if (idx == NULL) goto error;
                PyList_SET_ITEM(admitted, j, idx);
            }
        }
    }
    PyBuffer_Release(&buf);
    if (admitted == NULL) Py_RETURN_NONE;
    return admitted;
error:
    Py_XDECREF(admitted);
    PyBuffer_Release(&buf);
    return NULL;
}

/* increment(table, keys, mask) -> None: count one sighting of every key. */
static PyObject *increment(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer buf;
    uint32_t mask;
    Py_ssize_t width;
    if (parse(args, nargs, 3, &buf, &mask, &width) < 0) return NULL;
    PyObject *keys = args[1];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (bump((unsigned char *)buf.buf, width, mask, PyList_GET_ITEM(keys, i)) < 0) {
            PyBuffer_Release(&buf);
            return NULL;
        }
    }
    PyBuffer_Release(&buf);
    Py_RETURN_NONE;
}

/* The minimum of the key's counters (the key is checked by the caller). */
static unsigned char count_of(const unsigned char *table, Py_ssize_t width, uint32_t mask,
                              PyObject *key) {
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(key);
    uint32_t g = group_of(p, PyBytes_GET_SIZE(key));
    unsigned char m = 255;
    for (int r = 0; r < ROWS; r++) {
        unsigned char c = table[(Py_ssize_t)r * width + ((load_u32(p + 4 * r) ^ g) & mask)];
        if (c < m) m = c;
    }
    return m;
}

/* estimate(table, key, mask) -> int: the key's count (the minimum of its counters). */
static PyObject *estimate(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer buf;
    uint32_t mask;
    Py_ssize_t width;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "estimate(table, key, mask)");
        return NULL;
    }
    if (parse_table(args[0], args[2], &buf, &mask, &width) < 0) return NULL;
    PyObject *key = args[1];
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) < 4 * ROWS) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "sketch keys must be bytes of at least 16 bytes");
        return NULL;
    }
    unsigned char m = count_of((const unsigned char *)buf.buf, width, mask, key);
    PyBuffer_Release(&buf);
    return PyLong_FromLong(m);
}

/* sample(table, keys, mask, limit) -> None | list: the keys whose byte 31 is
 * below `limit` (a hash sample of limit in 256), each followed by its count,
 * flat: [key, count, key, count, ...]; None if there are none. */
static PyObject *sample(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer buf;
    uint32_t mask;
    Py_ssize_t width;
    if (parse(args, nargs, 4, &buf, &mask, &width) < 0) return NULL;
    long limit = PyLong_AsLong(args[3]);
    if (limit == -1 && PyErr_Occurred()) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    PyObject *keys = args[1];
    PyObject *out = NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) < 32) {
            PyErr_SetString(PyExc_ValueError, "sampled keys must be bytes of at least 32 bytes");
            goto error;
        }
        if (((const unsigned char *)PyBytes_AS_STRING(key))[31] >= limit) continue;
        if (out == NULL && (out = PyList_New(0)) == NULL) goto error;
        PyObject *count = PyLong_FromLong(count_of((const unsigned char *)buf.buf, width, mask,
                                                   key));
        if (count == NULL || PyList_Append(out, key) < 0 || PyList_Append(out, count) < 0) {
            Py_XDECREF(count);
            goto error;
        }
        Py_DECREF(count);
    }
    PyBuffer_Release(&buf);
    if (out == NULL) Py_RETURN_NONE;
    return out;
error:
    Py_XDECREF(out);
    PyBuffer_Release(&buf);
    return NULL;
}

static PyMethodDef methods[] = {
    {"estimate", (PyCFunction)(void (*)(void))estimate, METH_FASTCALL,
     "estimate(table, key, mask) -> int"},
    {"sample", (PyCFunction)(void (*)(void))sample, METH_FASTCALL,
     "sample(table, keys, mask, limit) -> None | list"},
    {"offer", (PyCFunction)(void (*)(void))offer, METH_FASTCALL,
     "offer(table, keys, mask, threshold) -> None | list[int]"},
    {"increment", (PyCFunction)(void (*)(void))increment, METH_FASTCALL,
     "increment(table, keys, mask) -> None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sketch",
                                    "Frequency sketch kernels (see admission.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__sketch(void) { return PyModule_Create(&module); }
