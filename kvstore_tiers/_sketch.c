/* The frequency sketch's per-key work, compiled: kvstore_tiers/admission.py.
 *
 * Called once per store or load job on vLLM's scheduler thread; the Python
 * twins in admission.py (_offer_py, _increment_py, _estimate_py, _sample_py)
 * do exactly the same and a test checks that both agree, key by key.
 *
 * Table: 4 * width one-byte counters in a bytearray (width a power of two
 * >= 16), as width / 16 blocks of 64 bytes, one cache line each. A key's four
 * counters lie in one block, one in each 16-byte quarter (a blocked count-min,
 * as Caffeine's sketch): one cache miss per key instead of four, and the
 * misses of a job's keys are overlapped by prefetching them all first.
 *
 * A key is vLLM's OffloadKey: the block hash (32 bytes with sha256, 16 with
 * xxhash) then a 4-byte group index, so at least MIN_KEY bytes. Its block is
 * bytes [0, 4) read little endian, its counter in quarter r is bits 4r..4r+3
 * of bytes [4, 8), both XORed with a mix of its last 4 bytes (the group
 * index) so that the groups of one block count apart. The block hash is
 * uniform already, so slicing it is the hash.
 *
 * Conservative update: only the key's counters equal to its minimum are
 * incremented, saturating at MAX_COUNT.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ROWS 4
#define MAX_COUNT 15
/* A 16-byte block hash (xxhash) and the 4-byte group index. */
#define MIN_KEY 20

static uint32_t load_u32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

/* The key's group mix: its last 4 bytes, read as one u32, through murmur3's
 * finaliser so that every bit of it reaches the low bits. */
static uint32_t group_of(const unsigned char *p, Py_ssize_t n) {
    uint32_t g = load_u32(p + n - 4);
    g ^= g >> 16;
    g *= 0x85EBCA6Bu;
    g ^= g >> 13;
    g *= 0xC2B2AE35u;
    g ^= g >> 16;
    return g;
}

typedef struct {
    unsigned char *table;
    uint32_t block_mask; /* width / 16 - 1 */
} Sketch;

/* The key's block (64 counters) and, in `slot`, its counter's offset in each quarter. */
static unsigned char *locate(const Sketch *s, const unsigned char *p, Py_ssize_t n,
                             unsigned int slot[ROWS]) {
    uint32_t g = group_of(p, n);
    uint32_t bits = load_u32(p + 4) ^ g;
    for (int r = 0; r < ROWS; r++) slot[r] = 16u * r + ((bits >> (4 * r)) & 15u);
    return s->table + 64 * (Py_ssize_t)((load_u32(p) ^ g) & s->block_mask);
}

static int check_key(PyObject *key) {
    if (!PyBytes_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "sketch keys must be bytes");
        return -1;
    }
    if (PyBytes_GET_SIZE(key) < MIN_KEY) {
        PyErr_SetString(PyExc_ValueError, "sketch keys must be at least 20 bytes "
                        "(a 16-byte block hash and a 4-byte group index)");
        return -1;
    }
    return 0;
}

/* Increment `key` (conservatively) and return its count after; -1 on error. */
static int bump(const Sketch *s, PyObject *key) {
    if (check_key(key) < 0) return -1;
    unsigned int slot[ROWS];
    unsigned char *b = locate(s, (const unsigned char *)PyBytes_AS_STRING(key),
                              PyBytes_GET_SIZE(key), slot);
    unsigned char m = 255;
    for (int r = 0; r < ROWS; r++)
        if (b[slot[r]] < m) m = b[slot[r]];
    if (m >= MAX_COUNT) return MAX_COUNT;
    for (int r = 0; r < ROWS; r++)
        if (b[slot[r]] == m) b[slot[r]] = (unsigned char)(m + 1);
    return m + 1;
}

/* The key's count: the minimum of its counters (the key is checked by the caller). */
static int count_of(const Sketch *s, PyObject *key) {
    unsigned int slot[ROWS];
    const unsigned char *b = locate(s, (const unsigned char *)PyBytes_AS_STRING(key),
                                    PyBytes_GET_SIZE(key), slot);
    unsigned char m = 255;
    for (int r = 0; r < ROWS; r++)
        if (b[slot[r]] < m) m = b[slot[r]];
    return m;
}

/* Start loading every key's block, so that the cache misses overlap. */
static void prefetch(const Sketch *s, PyObject *keys) {
#if defined(__GNUC__) || defined(__clang__)
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) < MIN_KEY) continue;
        unsigned int slot[ROWS];
        __builtin_prefetch(locate(s, (const unsigned char *)PyBytes_AS_STRING(key),
                                  PyBytes_GET_SIZE(key), slot), 1);
    }
#else
    (void)s;
    (void)keys;
#endif
}

/* The table (a writable buffer of 4 * (mask + 1) bytes) and its mask (width - 1). */
static int parse_table(PyObject *table, PyObject *mask_obj, Py_buffer *buf, Sketch *s) {
    unsigned long m = PyLong_AsUnsignedLong(mask_obj);
    if (m == (unsigned long)-1 && PyErr_Occurred()) return -1;
    if (PyObject_GetBuffer(table, buf, PyBUF_WRITABLE) < 0) return -1;
    unsigned long width = m + 1;
    if (m > 0xFFFFFFFFul || width < 16 || (width & (width - 1)) ||
        buf->len != (Py_ssize_t)(ROWS * width)) {
        PyBuffer_Release(buf);
        PyErr_SetString(PyExc_ValueError,
                        "table must be 4 * (mask + 1) bytes, mask + 1 a power of two >= 16");
        return -1;
    }
    s->table = (unsigned char *)buf->buf;
    s->block_mask = (uint32_t)(width / 16 - 1);
    return 0;
}

/* (table, keys: list, mask, ...) */
static int parse(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, Py_buffer *buf,
                 Sketch *s) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments", want);
        return -1;
    }
    if (!PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "keys must be a list");
        return -1;
    }
    return parse_table(args[0], args[2], buf, s);
}

/* parse() for the calls (table, keys, mask, n) whose fourth argument is an
 * int, read into `value`; the buffer is released if that fails. */
static int parse_with_long(PyObject *const *args, Py_ssize_t nargs, Py_buffer *buf,
                           Sketch *s, long *value) {
    if (parse(args, nargs, 4, buf, s) < 0) return -1;
    *value = PyLong_AsLong(args[3]);
    if (*value == -1 && PyErr_Occurred()) {
        PyBuffer_Release(buf);
        return -1;
    }
    return 0;
}

/* offer(table, keys, mask, threshold) -> None | list[int]
 * Count one sighting of every key; None if every key's count reached
 * `threshold`, else the indices (ascending) of those that did. */
static PyObject *offer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer buf;
    Sketch s;
    long threshold;
    if (parse_with_long(args, nargs, &buf, &s, &threshold) < 0) return NULL;
    PyObject *keys = args[1];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *admitted = NULL; /* made at the first key that falls short */
    prefetch(&s, keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        int count = bump(&s, PyList_GET_ITEM(keys, i));
        if (count < 0) goto error;
        if (count >= threshold) {
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
    Sketch s;
    if (parse(args, nargs, 3, &buf, &s) < 0) return NULL;
    PyObject *keys = args[1];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    prefetch(&s, keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (bump(&s, PyList_GET_ITEM(keys, i)) < 0) {
            PyBuffer_Release(&buf);
            return NULL;
        }
    }
    PyBuffer_Release(&buf);
    Py_RETURN_NONE;
}

/* estimate(table, key, mask) -> int: the key's count. */
static PyObject *estimate(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer buf;
    Sketch s;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "estimate(table, key, mask)");
        return NULL;
    }
    if (check_key(args[1]) < 0 || parse_table(args[0], args[2], &buf, &s) < 0) return NULL;
    int m = count_of(&s, args[1]);
    PyBuffer_Release(&buf);
    return PyLong_FromLong(m);
}

/* sample(table, keys, mask, limit) -> None | list: the keys whose last hash
 * byte (the one before the group index) is below `limit` (a hash sample of
 * limit in 256), each followed by its count,
 * flat: [key, count, key, count, ...]; None if there are none. */
static PyObject *sample(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer buf;
    Sketch s;
    long limit;
    if (parse_with_long(args, nargs, &buf, &s, &limit) < 0) return NULL;
    PyObject *keys = args[1];
    PyObject *out = NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        Py_ssize_t size = PyBytes_Check(key) ? PyBytes_GET_SIZE(key) : 0;
        if (size < MIN_KEY) {
            PyErr_SetString(PyExc_ValueError, "sampled keys must be bytes of at least 20 bytes");
            goto error;
        }
        if (((const unsigned char *)PyBytes_AS_STRING(key))[size - 5] >= limit) continue;
        if (out == NULL && (out = PyList_New(0)) == NULL) goto error;
        PyObject *count = PyLong_FromLong(count_of(&s, key));
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
    {"offer", (PyCFunction)(void (*)(void))offer, METH_FASTCALL,
     "offer(table, keys, mask, threshold) -> None | list[int]"},
    {"increment", (PyCFunction)(void (*)(void))increment, METH_FASTCALL,
     "increment(table, keys, mask) -> None"},
    {"estimate", (PyCFunction)(void (*)(void))estimate, METH_FASTCALL,
     "estimate(table, key, mask) -> int"},
    {"sample", (PyCFunction)(void (*)(void))sample, METH_FASTCALL,
     "sample(table, keys, mask, limit) -> None | list"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sketch",
                                    "Frequency sketch kernels (see admission.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__sketch(void) { return PyModule_Create(&module); }
