/* The frequency sketch's per-key work, compiled: kvstore_tiers/admission.py.
 *
 * Called once per store job by the I/O thread that starts it and once per
 * load job by the I/O thread that runs it. The Python twins in admission.py
 * (_offer_py, _increment_py, _estimate_py) do exactly the same and
 * a test checks that both agree, key by key.
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
/* Items a samples list may hold (two per sampled sighting); past it, sightings
 * are not sampled until the adaptive policy's probe thread takes the list. */
#define SAMPLES_MAX (1 << 20)

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

/* (table, keys: list, mask, ...): the first three arguments of every call. */
static int parse(PyObject *const *args, Py_buffer *buf, Sketch *s) {
    if (!PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "keys must be a list");
        return -1;
    }
    return parse_table(args[0], args[2], buf, s);
}

/* The optional sample arguments (limit, samples) at args[at], args[at + 1]:
 * `samples` a list, or NULL when they are not given or it is None. */
typedef struct {
    long limit;
    PyObject *samples;
} Sampling;

static int parse_sampling(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t at,
                          Sampling *out) {
    out->limit = 0;
    out->samples = NULL;
    if (nargs == at) return 0;
    if (nargs != at + 2) {
        PyErr_Format(PyExc_TypeError, "expected %zd or %zd arguments", at, at + 2);
        return -1;
    }
    out->limit = PyLong_AsLong(args[at]);
    if (out->limit == -1 && PyErr_Occurred()) return -1;
    if (args[at + 1] == Py_None) return 0;
    if (!PyList_Check(args[at + 1])) {
        PyErr_SetString(PyExc_TypeError, "samples must be a list or None");
        return -1;
    }
    out->samples = args[at + 1];
    return 0;
}

/* A sighting of `key`, now counted `count`: if the key is in the hash sample
 * (its last hash byte, the one before the group index, below the limit) and
 * the samples list has room, append the key and its count. */
static int sample(const Sampling *sm, PyObject *key, int count) {
    if (sm->samples == NULL || PyList_GET_SIZE(sm->samples) >= SAMPLES_MAX) return 0;
    if (((const unsigned char *)PyBytes_AS_STRING(key))[PyBytes_GET_SIZE(key) - 5] >=
        sm->limit)
        return 0;
    PyObject *c = PyLong_FromLong(count);
    if (c == NULL) return -1;
    if (PyList_Append(sm->samples, key) < 0) {
        Py_DECREF(c);
        return -1;
    }
    if (PyList_Append(sm->samples, c) < 0) {
        /* Take the key back out: the list stays [key, count, ...] pairs. */
        Py_ssize_t n = PyList_GET_SIZE(sm->samples);
        PyList_SetSlice(sm->samples, n - 1, n, NULL);
        Py_DECREF(c);
        return -1;
    }
    Py_DECREF(c);
    return 0;
}

/* offer(table, keys, mask, threshold[, limit, samples]) -> None | list[int]
 * Count one sighting of every key; None if every key's count reached
 * `threshold`, else the indices (ascending) of those that did. With `limit`
 * and `samples`, also sample the sightings (see sample()). */
static PyObject *offer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer buf;
    Sketch s;
    Sampling sm;
    if (nargs < 4) {
        PyErr_SetString(PyExc_TypeError, "offer(table, keys, mask, threshold[, limit, samples])");
        return NULL;
    }
    long threshold = PyLong_AsLong(args[3]);
    if (threshold == -1 && PyErr_Occurred()) return NULL;
    if (parse_sampling(args, nargs, 4, &sm) < 0 || parse(args, &buf, &s) < 0) return NULL;
    PyObject *keys = args[1];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *admitted = NULL; /* made at the first key that falls short */
    prefetch(&s, keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        int count = bump(&s, key);
        if (count < 0 || sample(&sm, key, count) < 0) goto error;
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

/* increment(table, keys, mask[, limit, samples]) -> None: count one sighting
 * of every key (and sample them, as offer). */
static PyObject *increment(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer buf;
    Sketch s;
    Sampling sm;
    if (nargs < 3) {
        PyErr_SetString(PyExc_TypeError, "increment(table, keys, mask[, limit, samples])");
        return NULL;
    }
    if (parse_sampling(args, nargs, 3, &sm) < 0 || parse(args, &buf, &s) < 0) return NULL;
    PyObject *keys = args[1];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    prefetch(&s, keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        int count = bump(&s, key);
        if (count < 0 || sample(&sm, key, count) < 0) {
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

static PyMethodDef methods[] = {
    {"offer", (PyCFunction)(void (*)(void))offer, METH_FASTCALL,
     "offer(table, keys, mask, threshold[, limit, samples]) -> None | list[int]"},
    {"increment", (PyCFunction)(void (*)(void))increment, METH_FASTCALL,
     "increment(table, keys, mask[, limit, samples]) -> None"},
    {"estimate", (PyCFunction)(void (*)(void))estimate, METH_FASTCALL,
     "estimate(table, key, mask) -> int"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sketch",
                                    "Frequency sketch kernels (see admission.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__sketch(void) { return PyModule_Create(&module); }
