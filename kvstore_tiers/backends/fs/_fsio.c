/* kvstore_tiers.backends.fs._fsio: the fs tier's per-block file I/O, one
 * GIL-free call each.
 *
 * publish_file(tmp, path, buffers, flags[, crc_of, crc_at]) -> n
 *
 *   Unless ``path`` exists already (then it returns 0 and writes nothing):
 *   creates ``tmp`` (O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC | ``flags``, mode
 *   0644), writes ``buffers`` with one vectored write (with crc_of: below),
 *   closes it and renames it to ``path``: an atomic publish. A rename that reports EEXIST lost a
 *   publish race to another writer of the same (content-addressed) object:
 *   ``tmp`` is removed and the result is 0, as if it had existed. A short
 *   write is followed by a write of the rest, so an error carries the
 *   kernel's reason (ENOSPC on a full disk; EIO only if no error is given).
 *   On any error ``tmp`` is removed and ``path`` is untouched.
 *
 * publish_files(items, piece=0) -> list
 *
 *   publish_file for each (tmp, path, buffers, flags[, crc_of, crc_at]) of
 *   ``items`` (at most 64), with the GIL released once for all of them. Per
 *   item, in order: the bytes written (0: it existed) or the OSError it met,
 *   returned, not raised.
 *
 *   With crc_of (a buffer after the first; refused where the CPU has no
 *   CRC-32C instruction), the CRC-32C of that buffer goes little-endian at
 *   byte ``crc_at`` of a copy of buffer 0 (a frame's header), computed in
 *   the same GIL-free stretch (write_summed). With ``piece`` > 0, where the
 *   CPU folds the CRC and the flags lack O_DIRECT, that buffer is
 *   checksummed and written ``piece`` bytes at a time, each while in cache,
 *   and the header last; otherwise the checksum comes first, then the one
 *   vectored write.
 *
 * read_files(items, threads=1, piece=0) -> list
 *
 *   For each (path, buffers, flags) of ``items`` (at most 64), with the GIL
 *   released once for all of them, on up to ``threads`` threads at once (the
 *   calling one and helper threads the module keeps across calls, at most 64;
 *   ``threads`` is shared out among the calls running at the time, each
 *   keeping at least its own):
 *   opens ``path`` read-only (O_CLOEXEC |
 *   ``flags``, e.g. O_DIRECT), reads it from offset 0 into ``buffers``
 *   (writable buffers, in order) with one vectored read (with ``piece``,
 *   several: below) and closes it. Per
 *   item, in order: (n, size), the bytes read and the file's size, or the
 *   OSError it met, returned, not raised. The size is ``n`` when the read
 *   stopped short of filling the buffers (it met end of file); otherwise an
 *   fstat gives it.
 *
 *   An item (path, buffers, flags, crc_of) also asks for the CRC-32C of
 *   buffer ``crc_of`` once the read has filled it, computed in the same
 *   GIL-free stretch: its result is (n, size, crc), crc None where the read
 *   stopped short of that buffer's end or the CPU has no CRC-32C
 *   instruction (the caller then checksums it itself). With ``piece`` > 0,
 *   where the CPU folds the CRC (CRC32C_FOLD) and the item's flags lack
 *   O_DIRECT, that buffer is read ``piece`` bytes at a time instead, each
 *   checksummed as it lands (read_checksummed): for files in memory (tmpfs),
 *   whose reads are the kernel's copy, so the checksum finds the bytes in
 *   cache.
 *
 * exists_files(paths) -> list[bool]
 *
 *   Whether each path exists (access(F_OK) succeeds; any error is False, as
 *   os.path.exists answers), with the GIL released once for all of them: an
 *   async lookup's batch is one call.
 *
 * Errors raise OSError with errno and the failing path set (FileNotFoundError
 * for ENOENT, ...), as os.open / os.readv / os.replace would.
 *
 * Why native: in Python the same work is three to five syscalls, and each
 * releases the GIL and must take it back; with several I/O threads and the
 * scheduler loop on two cores every re-take is a wait. Here the GIL is
 * released once per block. The same goes for a load's checksum: the crc32c
 * package releases and re-takes the GIL for every block, so a batch that
 * asks for it gets it here, inside the one GIL-free stretch.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_BUFFERS 8

/* CRC-32C (Castagnoli, the frame's checksum; crc32c.crc32c(data) of the
 * package frame.py uses) with the CPU's instruction: SSE 4.2 on x86-64 (checked
 * at import), the CRC extension on AArch64 (at compile time). Elsewhere
 * crc_insn is 0 and no checksum is computed here. Each architecture gives
 * its byte and 8-byte steps; crc32c_of, below, is shared by both. */
static int crc_insn;
static int crc_fold; /* set where crc_folded (below) runs */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_CRC_INSN 1
#define CRC_TARGET __attribute__((target("sse4.2")))
CRC_TARGET static inline uint32_t
crc_step8(uint32_t c, unsigned char b)
{
    return __builtin_ia32_crc32qi(c, b);
}
CRC_TARGET static inline uint32_t
crc_step64(uint32_t c, uint64_t v)
{
    return (uint32_t)__builtin_ia32_crc32di(c, v);
}
static int
crc_insn_present(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2");
}
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#define HAVE_CRC_INSN 1
#define CRC_TARGET
static inline uint32_t
crc_step8(uint32_t c, unsigned char b)
{
    return __crc32cb(c, b);
}
static inline uint32_t
crc_step64(uint32_t c, uint64_t v)
{
    return __crc32cd(c, v);
}
static int
crc_insn_present(void)
{
    return 1;
}
#else
static int
crc_insn_present(void)
{
    return 0;
}
#endif

#ifdef HAVE_CRC_INSN
/* The instruction's latency is several times its issue interval (three
 * cycles against one on x86-64), so one stream through a buffer leaves it
 * mostly idle. Buffers of three spans of CRC_SPAN bytes and more go as three
 * streams side by side, over three consecutive spans; the CRC being linear,
 * the stream of a span is joined to the next by "appending CRC_SPAN zero
 * bytes" to it (a 32x32 matrix over GF(2), applied through four 256-entry
 * tables, one per byte of the CRC) and XORing the next span's own CRC. This
 * is the method of Mark Adler's crc32c.c, also the crc32c package's, which
 * also interleaves shorter spans; here what is left after the long spans
 * (under 24 KiB) stays one stream, a small part of a row. The tables are
 * built once at import. tests/backends/fs/test_fs_io.py tests lengths around
 * three spans of 8192 bytes. */
#define CRC_SPAN 8192
_Static_assert((CRC_SPAN & (CRC_SPAN - 1)) == 0 && CRC_SPAN % 8 == 0,
               "the zero-bytes operator is built for a power of two of 8-byte words");
#define CRC32C_POLY 0x82f63b78u /* reflected */
static uint32_t crc_span_zeros[4][256];

static uint32_t
gf2_times(const uint32_t *mat, uint32_t vec)
{
    uint32_t sum = 0;
    for (; vec; vec >>= 1, mat++)
        if (vec & 1)
            sum ^= *mat;
    return sum;
}

static void
gf2_square(uint32_t *square, const uint32_t *mat)
{
    for (int n = 0; n < 32; n++)
        square[n] = gf2_times(mat, mat[n]);
}

/* The tables that append CRC_SPAN (a power of two) zero bytes to a CRC. */
static void
crc_span_init(void)
{
    uint32_t odd[32], even[32];
    odd[0] = CRC32C_POLY; /* one zero bit */
    for (int n = 1; n < 32; n++)
        odd[n] = 1u << (n - 1);
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four */
    const uint32_t *op = odd;
    /* Each square doubles: 1 byte, 2, 4, ... until CRC_SPAN bytes. */
    for (size_t len = CRC_SPAN;;) {
        gf2_square(even, odd);
        op = even;
        if ((len >>= 1) == 0)
            break;
        gf2_square(odd, even);
        op = odd;
        if ((len >>= 1) == 0)
            break;
    }
    for (uint32_t b = 0; b < 256; b++)
        for (int i = 0; i < 4; i++)
            crc_span_zeros[i][b] = gf2_times(op, b << (8 * i));
}

static inline uint32_t
crc_span_shift(uint32_t c)
{
    return crc_span_zeros[0][c & 0xff] ^ crc_span_zeros[1][(c >> 8) & 0xff] ^
           crc_span_zeros[2][(c >> 16) & 0xff] ^ crc_span_zeros[3][c >> 24];
}

/* The CRC register ``c`` (not inverted) after the bytes p[0..n). */
CRC_TARGET static uint32_t
crc_streams(uint32_t c, const unsigned char *p, size_t n)
{
    for (; n && ((uintptr_t)p & 7); n--)
        c = crc_step8(c, *p++);
    for (; n >= 3 * CRC_SPAN; n -= 3 * CRC_SPAN, p += 3 * CRC_SPAN) {
        uint32_t c1 = 0, c2 = 0;
        for (size_t i = 0; i < CRC_SPAN; i += 8) {
            uint64_t v0, v1, v2;
            memcpy(&v0, p + i, 8);
            memcpy(&v1, p + CRC_SPAN + i, 8);
            memcpy(&v2, p + 2 * CRC_SPAN + i, 8);
            c = crc_step64(c, v0);
            c1 = crc_step64(c1, v1);
            c2 = crc_step64(c2, v2);
        }
        c = crc_span_shift(c) ^ c1;
        c = crc_span_shift(c) ^ c2;
    }
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = crc_step64(c, v);
    }
    for (; n; n--)
        c = crc_step8(c, *p++);
    return c;
}
#endif

/* GCC 9 and clang 8 know the VPCLMULQDQ target and its CPU feature name. */
#if defined(HAVE_CRC_INSN) && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 8) || (!defined(__clang__) && __GNUC__ >= 9))
/* Where the CPU has VPCLMULQDQ and AVX-512, the CRC of long buffers is
 * computed by folding instead: carry-less multiplication moves 128-bit
 * blocks of the message forward, modulo the polynomial, onto later ones
 * (Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ",
 * 2009, with 512-bit registers), and the CRC instruction finishes the
 * 128-bit remainder. Four registers of 64 bytes fold side by side, 256
 * bytes a step, so the multiplier's latency is hidden: several times the
 * three streams' rate on bytes in cache, which is what lets a read
 * checksum each piece as it lands (read_checksummed), and a publish each
 * piece before its write (write_summed), for a few percent of the copy's
 * cost. The constants are powers of x modulo the polynomial, computed at
 * import. tests/backends/fs/test_fs_io.py checks it against
 * the crc32c package around every boundary, and with
 * KVSTORE_TIERS_FS_CRC_FOLD=0 (which turns folding off) the streams. */
#define HAVE_CRC_FOLD 1
#define FOLD_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))
#include <immintrin.h>
/* Per fold distance: the multipliers of a 128-bit block's first and second
 * 8 bytes. */
static uint64_t fold_256[2], fold_64[2], fold_16[2];

/* x^n mod P, reflected (bit i holds the coefficient of x^(31 - i)). */
static uint32_t
xpow_mod(uint64_t n)
{
    uint32_t r = 0x80000000u;
    for (; n; n--)
        r = (r & 1) ? (r >> 1) ^ CRC32C_POLY : r >> 1;
    return r;
}

/* The multipliers that move a block ``bytes`` forward. A block is A_1 x^64
 * + A_2 (A_1 its first 8 bytes): moved, A_1 x^(d + 64) + A_2 x^d for d =
 * 8 * bytes. A reflected carry-less product comes out one bit short
 * (x^-1), so each multiplier is x^(e - 1) mod P, placed in a 64-bit word's
 * high half. */
static void
fold_init(uint64_t *k, uint64_t bytes)
{
    k[0] = (uint64_t)xpow_mod(8 * bytes + 64 - 1) << 32;
    k[1] = (uint64_t)xpow_mod(8 * bytes - 1) << 32;
}

/* a moved forward by the multipliers in k's lanes, XOR b. */
FOLD_TARGET static inline __m512i
fold512(__m512i a, __m512i k, __m512i b)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a, k, 0x00),
                                     _mm512_clmulepi64_epi128(a, k, 0x11), b, 0x96);
}

FOLD_TARGET static inline __m128i
fold128(__m128i a, __m128i k, __m128i b)
{
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, k, 0x00),
                                       _mm_clmulepi64_si128(a, k, 0x11)), b);
}

/* The multipliers k in each of a register's four 128-bit lanes. */
FOLD_TARGET static inline __m512i
fold_lanes(const uint64_t *k)
{
    return _mm512_broadcast_i32x4(_mm_set_epi64x((long long)k[1], (long long)k[0]));
}

/* How far ahead of the fold its loads are asked for. A row the device
 * moved by DMA (O_DIRECT) is in memory, not in cache, and the hardware's
 * prefetcher alone leaves the fold waiting on it; a few KiB ahead keeps
 * enough of it on the way (docs/benchmarks.md). Never past the row's end. */
#define FOLD_AHEAD 4096

/* The CRC register after p[0..n), n a multiple of 256 and at least 256. */
FOLD_TARGET static uint32_t
crc_folded(uint32_t c, const unsigned char *p, size_t n)
{
    __m512i k = fold_lanes(fold_256);
    /* The register is the message's first 32 bits XORed with it. */
    __m512i a0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_maskz_set1_epi32(1, (int)c));
    __m512i a1 = _mm512_loadu_si512(p + 64), a2 = _mm512_loadu_si512(p + 128),
            a3 = _mm512_loadu_si512(p + 192);
    for (p += 256, n -= 256; n; p += 256, n -= 256) {
        if (n >= FOLD_AHEAD + 256)
            for (int i = 0; i < 256; i += 64)
                _mm_prefetch((const char *)p + FOLD_AHEAD + i, _MM_HINT_T0);
        a0 = fold512(a0, k, _mm512_loadu_si512(p));
        a1 = fold512(a1, k, _mm512_loadu_si512(p + 64));
        a2 = fold512(a2, k, _mm512_loadu_si512(p + 128));
        a3 = fold512(a3, k, _mm512_loadu_si512(p + 192));
    }
    k = fold_lanes(fold_64);
    a1 = fold512(a0, k, a1);
    a2 = fold512(a1, k, a2);
    a3 = fold512(a2, k, a3);
    __m128i k16 = _mm_set_epi64x((long long)fold_16[1], (long long)fold_16[0]);
    __m128i x = _mm512_extracti32x4_epi32(a3, 0);
    x = fold128(x, k16, _mm512_extracti32x4_epi32(a3, 1));
    x = fold128(x, k16, _mm512_extracti32x4_epi32(a3, 2));
    x = fold128(x, k16, _mm512_extracti32x4_epi32(a3, 3));
    c = (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x));
    return (uint32_t)_mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(x, 1));
}

static int
crc_fold_present(void)
{
    const char *env = getenv("KVSTORE_TIERS_FS_CRC_FOLD");
    if (env != NULL && strcmp(env, "0") == 0)
        return 0;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
           __builtin_cpu_supports("pclmul");
}
#endif

#ifdef HAVE_CRC_INSN
/* The CRC register after p[0..n): folded where it can be, the rest as
 * three streams. */
static uint32_t
crc_update(uint32_t c, const unsigned char *p, size_t n)
{
#ifdef HAVE_CRC_FOLD
    if (crc_fold && n >= 256) {
        size_t m = n & ~(size_t)255;
        c = crc_folded(c, p, m);
        p += m;
        n -= m;
    }
#endif
    return crc_streams(c, p, n);
}
#else
static void
crc_span_init(void)
{
}

static uint32_t
crc_update(uint32_t c, const unsigned char *p, size_t n)
{
    (void)p;
    (void)n;
    return c; /* never called: crc_insn is 0 */
}
#endif

static uint32_t
crc32c_of(const unsigned char *p, size_t n)
{
    return ~crc_update(0xFFFFFFFFu, p, n);
}

/* The buffers of one call, exported for the kernel's iovec. */
typedef struct {
    PyObject *seq;
    Py_buffer views[MAX_BUFFERS];
    struct iovec iov[MAX_BUFFERS];
    Py_ssize_t count; /* views held */
    Py_ssize_t total; /* bytes */
} Buffers;

/* Export every buffer of the sequence ``obj``. 0, or -1 with an exception
 * set; either way buffers_release() must follow. */
static int
buffers_get(Buffers *b, PyObject *obj, int writable)
{
    b->count = b->total = 0;
    b->seq = PySequence_Fast(obj, "buffers must be a sequence");
    if (b->seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(b->seq);
    if (n < 1 || n > MAX_BUFFERS) {
        PyErr_Format(PyExc_ValueError, "takes 1 to %d buffers", MAX_BUFFERS);
        return -1;
    }
    for (; b->count < n; b->count++) {
        Py_buffer *view = &b->views[b->count];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(b->seq, b->count), view,
                               writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
            return -1;
        b->iov[b->count].iov_base = view->buf;
        b->iov[b->count].iov_len = (size_t)view->len;
        b->total += view->len;
    }
    return 0;
}

static void
buffers_release(Buffers *b)
{
    for (Py_ssize_t i = 0; i < b->count; i++)
        PyBuffer_Release(&b->views[i]);
    Py_XDECREF(b->seq);
}

/* A new OSError(err, strerror, name), built as its subclass
 * (FileNotFoundError for ENOENT, ...); NULL with an exception set if even
 * that fails. */
static PyObject *
oserror_new(int err, const char *name)
{
    PyObject *fname = PyUnicode_DecodeFSDefault(name);
    if (fname == NULL)
        return NULL;
    PyObject *exc = PyObject_CallFunction(PyExc_OSError, "isO", err, strerror(err), fname);
    Py_DECREF(fname);
    return exc;
}

/* NULL with OSError(err, strerror, name) raised. */
static PyObject *
oserror(int err, const char *name)
{
    PyObject *exc = oserror_new(err, name);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/* pwrite of all ``len`` bytes at ``at``: 0, or the errno (EIO if a write
 * makes no progress without one). */
static int
pwrite_all(int fd, const unsigned char *p, size_t len, off_t at)
{
    while (len > 0) {
        ssize_t w = pwrite(fd, p, len, at);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return errno;
        if (w == 0)
            return EIO;
        p += w;
        len -= (size_t)w;
        at += w;
    }
    return 0;
}

/* After a short writev of ``done`` bytes from the start of a new file: write
 * the rest, buffer by buffer, so a failure reports the kernel's reason
 * (ENOSPC on a full disk) rather than a bare short count. Returns 0 once
 * everything is written, else the errno. */
static int
write_rest(int fd, const struct iovec *iov, int count, size_t done)
{
    off_t at = (off_t)done;
    for (int i = 0; i < count; i++) {
        size_t len = iov[i].iov_len;
        if (done >= len) {
            done -= len;
            continue;
        }
        int err = pwrite_all(fd, (const unsigned char *)iov[i].iov_base + done, len - done, at);
        if (err != 0)
            return err;
        at += (off_t)(len - done);
        done = 0;
    }
    return 0;
}

/* writev of all ``count`` buffers, then the rest after a short write (see
 * write_rest): 0 or an errno; *n the bytes written. */
static int
writev_all(int fd, const struct iovec *iov, int count, size_t total, ssize_t *n)
{
    do {
        *n = writev(fd, iov, count);
    } while (*n < 0 && errno == EINTR);
    if (*n < 0)
        return errno;
    if ((size_t)*n == total)
        return 0;
    /* A short write: the filesystem is full or failing; the rest says why. */
    int err = write_rest(fd, iov, count, (size_t)*n);
    if (err == 0)
        *n = (ssize_t)total;
    return err;
}

/* What a publish checksums (see publish_files): the CRC-32C of buffer
 * ``of`` goes, little-endian, at byte ``at`` of buffer 0; ``piece`` as for
 * read_files. of < 0: nothing. */
typedef struct {
    int of, at;
    size_t piece;
} Sum;

/* Write ``b`` to the new file ``fd`` with buffer 0 replaced by a copy that
 * holds the checksum ``sum`` asks for (the caller's buffer is not changed).
 * Where the fold runs and ``piece`` is set, buffer ``of`` is checksummed a
 * piece at a time, each written while the checksum has left it in cache,
 * and the copy of buffer 0 is written last (the file is a temp file: the
 * order is not seen). Otherwise the checksum comes first, then one writev
 * (O_DIRECT keeps the device's request whole). 0 or an errno; *n the bytes
 * written. */
static int
write_summed(int fd, const Buffers *b, int flags, Sum sum, ssize_t *n)
{
    const struct iovec *row = &b->iov[sum.of];
    size_t head = b->iov[0].iov_len;
    unsigned char *copy = NULL; /* page-aligned, as O_DIRECT wants it */
    if (posix_memalign((void **)&copy, 4096, head) != 0)
        return ENOMEM;
    memcpy(copy, b->iov[0].iov_base, head);
    struct iovec v[MAX_BUFFERS];
    memcpy(v, b->iov, sizeof(struct iovec) * (size_t)b->count);
    v[0].iov_base = copy;
    uint32_t c = 0xFFFFFFFFu;
    int err = 0;
    int hot = crc_fold && sum.piece > 0;
#ifdef O_DIRECT
    hot = hot && !(flags & O_DIRECT);
#else
    (void)flags;
#endif
    *n = -1;
    if (hot) {
        /* The file at its full size first: a tmpfs mounted huge=within_size
         * gives a range a huge page only when the file already covers it,
         * and pieces written out of order never would. */
        if (ftruncate(fd, (off_t)b->total) != 0)
            err = errno;
        off_t at = 0;
        for (int i = 1; i < b->count && err == 0; at += (off_t)v[i].iov_len, i++) {
            const unsigned char *p = v[i].iov_base;
            size_t len = v[i].iov_len, step = len;
            for (size_t done = 0; done < len && err == 0; done += step) {
                if (i == sum.of) {
                    step = len - done < sum.piece ? len - done : sum.piece;
                    c = crc_update(c, p + done, step);
                }
                err = pwrite_all(fd, p + done, step, (off_t)head + at + (off_t)done);
            }
        }
    } else {
        c = crc_update(c, row->iov_base, row->iov_len);
    }
    c = ~c;
    for (int i = 0; i < 4; i++)
        copy[sum.at + i] = (unsigned char)(c >> (8 * i));
    if (err == 0 && hot) {
        err = pwrite_all(fd, copy, head, 0);
        if (err == 0)
            *n = b->total;
    } else if (err == 0) {
        err = writev_all(fd, v, (int)b->count, (size_t)b->total, n);
    }
    free(copy);
    return err;
}

/* The publish itself (see publish_file above); runs without the GIL. Returns 0
 * or an errno, with *n the bytes written (0: ``path`` existed) and *failed the
 * name an error is reported against. */
static int
publish_one(const char *tmp, const char *path, const Buffers *b, int flags, Sum sum,
            ssize_t *n, const char **failed)
{
    int err = 0;
    *n = -1;
    *failed = tmp;
    if (access(path, F_OK) == 0) {
        *n = 0; /* stored already (by us or another process): nothing to do */
        return 0;
    }
    int fd;
    do {
        fd = open(tmp, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC | flags, 0644);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0)
        return errno;
    if (sum.of >= 0)
        err = write_summed(fd, b, flags, sum, n);
    else
        err = writev_all(fd, b->iov, (int)b->count, (size_t)b->total, n);
    if (close(fd) != 0 && err == 0)
        err = errno; /* NFS reports write-back errors here */
    if (err == 0 && rename(tmp, path) != 0) {
        if (errno == EEXIST) {
            /* Another writer published the same object first: it is there. */
            *n = 0;
            unlink(tmp);
            return 0;
        }
        err = errno;
        *failed = path;
    }
    if (err != 0)
        unlink(tmp);
    return err;
}

/* 0 if ``sum`` fits the buffers ``b`` (see publish_files), else -1 with
 * ValueError set. */
static int
sum_check(Sum sum, const Buffers *b)
{
    if (sum.of < 0)
        return 0;
    if (!crc_insn) {
        PyErr_SetString(PyExc_ValueError, "no CRC-32C instruction here: checksum before publishing");
        return -1;
    }
    if (sum.of < 1 || sum.of >= b->count || sum.at < 0 ||
        (size_t)sum.at + 4 > b->iov[0].iov_len) {
        PyErr_SetString(PyExc_ValueError,
                        "crc_of must name a buffer after the first, and crc_at 4 bytes of the first");
        return -1;
    }
    return 0;
}

static PyObject *
publish_file(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *tmp_obj = NULL, *path_obj = NULL; /* bytes, from PyUnicode_FSConverter */
    PyObject *seq_obj;
    int flags;
    Sum sum = {-1, -1, 0};
    /* On failure the converters release what they made (Py_CLEANUP_SUPPORTED). */
    if (!PyArg_ParseTuple(args, "O&O&Oi|ii:publish_file", PyUnicode_FSConverter, &tmp_obj,
                          PyUnicode_FSConverter, &path_obj, &seq_obj, &flags, &sum.of, &sum.at))
        return NULL;
    Buffers b;
    PyObject *result = NULL;
    if (buffers_get(&b, seq_obj, 0) < 0 || sum_check(sum, &b) < 0)
        goto out;

    const char *failed;
    ssize_t n;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = publish_one(PyBytes_AS_STRING(tmp_obj), PyBytes_AS_STRING(path_obj), &b, flags, sum,
                      &n, &failed);
    Py_END_ALLOW_THREADS

    result = err ? oserror(err, failed) : PyLong_FromSsize_t(n);
out:
    buffers_release(&b);
    Py_DECREF(tmp_obj);
    Py_DECREF(path_obj);
    return result;
}

/* One file of publish_files or read_files: its names, buffers, flags and
 * outcome. */
typedef struct {
    PyObject *tmp, *path; /* bytes, from PyUnicode_FSConverter; no tmp to read */
    Buffers b;
    int flags;
    int err;
    ssize_t n;
    off_t size;
    const char *failed;
    int crc_of;  /* the buffer to checksum, -1 none */
    int crc_at;  /* publishing: where in buffer 0 its checksum goes */
    size_t piece; /* checksum crc_of piece by piece (0: the whole buffer at once) */
    int has_crc; /* crc was computed */
    uint32_t crc;
} Item;

#define MAX_ITEMS 64

/* Parse ``items_obj``, a sequence of at most MAX_ITEMS tuples -- (tmp, path,
 * buffers, flags[, crc_of, crc_at]) to publish, (path, buffers, flags[,
 * crc_of]) to read -- into a new
 * array at *items, of which *ready entries hold references. Returns the
 * count, or -1 with an exception set; items_free() must follow either way. */
static Py_ssize_t
items_get(PyObject *items_obj, int reading, Item **items, Py_ssize_t *ready)
{
    *items = NULL;
    *ready = 0;
    PyObject *seq = PySequence_Fast(items_obj, "items must be a sequence");
    if (seq == NULL)
        return -1;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count > MAX_ITEMS) {
        PyErr_Format(PyExc_ValueError, "takes at most %d items", MAX_ITEMS);
        goto fail;
    }
    *items = PyMem_Calloc((size_t)(count ? count : 1), sizeof(Item));
    if (*items == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (; *ready < count; (*ready)++) {
        Item *it = &(*items)[*ready];
        PyObject *tuple = PySequence_Fast_GET_ITEM(seq, *ready), *buffers;
        it->crc_of = it->crc_at = -1;
        int ok = reading
            ? PyArg_ParseTuple(tuple, "O&Oi|i;an item is (path, buffers, flags[, crc_of])",
                               PyUnicode_FSConverter, &it->path, &buffers, &it->flags,
                               &it->crc_of)
            : PyArg_ParseTuple(tuple,
                               "O&O&Oi|ii;an item is (tmp, path, buffers, flags[, crc_of, crc_at])",
                               PyUnicode_FSConverter, &it->tmp, PyUnicode_FSConverter,
                               &it->path, &buffers, &it->flags, &it->crc_of, &it->crc_at);
        if (!ok)
            goto fail;
        if (buffers_get(&it->b, buffers, reading) < 0) {
            (*ready)++; /* its names and any views it took are released by items_free */
            goto fail;
        }
        if (reading && it->crc_of >= it->b.count) {
            (*ready)++;
            PyErr_SetString(PyExc_ValueError, "crc_of is not one of the item's buffers");
            goto fail;
        }
        if (!reading && sum_check((Sum){it->crc_of, it->crc_at, 0}, &it->b) < 0) {
            (*ready)++;
            goto fail;
        }
    }
    Py_DECREF(seq); /* each item holds its own references from here */
    return count;
fail:
    Py_DECREF(seq);
    return -1;
}

static void
items_free(Item *items, Py_ssize_t ready)
{
    for (Py_ssize_t i = 0; items != NULL && i < ready; i++) {
        buffers_release(&items[i].b); /* calloc'd: safe before buffers_get too */
        Py_XDECREF(items[i].tmp);
        Py_XDECREF(items[i].path);
    }
    PyMem_Free(items);
}

/* preadv of all ``count`` buffers from ``at``, again after a short read
 * until end of file: the bytes read, or -1 with errno set. */
static ssize_t
preadv_full(int fd, struct iovec *v, int count, off_t at)
{
    ssize_t total = 0;
    while (count > 0) {
        ssize_t r = preadv(fd, v, count, at + total);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -1;
        if (r == 0)
            break; /* end of file */
        total += r;
        for (; count > 0 && (size_t)r >= v->iov_len; count--, v++)
            r -= (ssize_t)v->iov_len;
        if (count > 0) {
            v->iov_base = (char *)v->iov_base + r;
            v->iov_len -= (size_t)r;
        }
    }
    return total;
}

/* The read of an item that asks for a checksum piece by piece (see
 * read_files above): buffer crc_of is read it->piece bytes at a time, each
 * checksummed while the kernel's copy has left it in cache (the buffers
 * before crc_of go with the first piece, those after it with the last).
 * Sets it->n and, once the buffer is filled, it->crc; returns 0 or an
 * errno. A piece that stops short has met the end of the file. */
static int
read_checksummed(int fd, Item *it)
{
    const Buffers *b = &it->b;
    const struct iovec *row = &b->iov[it->crc_of];
    const unsigned char *base = row->iov_base;
    struct iovec v[MAX_BUFFERS];
    uint32_t c = 0xFFFFFFFFu;
    size_t done = 0;
    it->n = 0;
    for (;;) {
        int k = 0;
        size_t before = 0;
        if (done == 0)
            for (; k < it->crc_of; k++)
                before += (v[k] = b->iov[k]).iov_len;
        size_t piece = row->iov_len - done < it->piece ? row->iov_len - done : it->piece;
        v[k].iov_base = (void *)(base + done);
        v[k++].iov_len = piece;
        int last = done + piece == row->iov_len;
        for (int i = it->crc_of + 1; last && i < b->count; i++)
            v[k++] = b->iov[i];
        ssize_t r = preadv_full(fd, v, k, (off_t)it->n);
        if (r < 0)
            return errno;
        it->n += r;
        if ((size_t)r < before + piece)
            return 0; /* the file ended inside the buffer: no checksum */
        c = crc_update(c, base + done, piece);
        done += piece;
        if (last) {
            it->crc = ~c;
            it->has_crc = 1;
            return 0;
        }
    }
}

/* One file of read_files (see above): open, read -- checksumming the
 * buffer asked for, as it lands where it can -- and close; runs without the
 * GIL. Sets it->err, it->n (the bytes read) and it->size (the file's). */
static void
read_item(Item *it)
{
    const char *path = it->failed = PyBytes_AS_STRING(it->path);
    const Buffers *b = &it->b;
    it->n = it->size = -1;
    int fd;
    do {
        fd = open(path, O_RDONLY | O_CLOEXEC | it->flags);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        it->err = errno;
        return;
    }
    int crc = it->crc_of >= 0 && crc_insn;
    /* Without folding, checksumming pieces measured no gain; O_DIRECT moves
     * the bytes without the cache, so pieces would only make the device's
     * requests smaller. */
    int hot = crc && crc_fold && it->piece > 0;
#ifdef O_DIRECT
    hot = hot && !(it->flags & O_DIRECT);
#endif
    if (hot) {
        it->err = read_checksummed(fd, it);
    } else {
        do {
            it->n = readv(fd, b->iov, (int)b->count);
        } while (it->n < 0 && errno == EINTR);
        it->err = it->n < 0 ? errno : 0;
    }
    if (!it->err && it->n == b->total) {
        struct stat st;
        if (fstat(fd, &st) == 0)
            it->size = st.st_size;
        else
            it->err = errno;
    } else if (!it->err) {
        it->size = it->n;
    }
    close(fd); /* read-only: a failed close loses nothing */
    if (!it->err && crc && !hot) {
        /* The CRC-32C of buffer crc_of, if the read filled it. */
        size_t end = 0;
        for (int i = 0; i <= it->crc_of; i++)
            end += b->iov[i].iov_len;
        if ((size_t)it->n >= end) {
            it->crc = crc32c_of(b->iov[it->crc_of].iov_base, b->iov[it->crc_of].iov_len);
            it->has_crc = 1;
        }
    }
}

/* The reads of one read_files call, taken one at a time by whichever of its
 * threads is free. */
typedef struct Gang {
    Item *items;
    Py_ssize_t count;
    Py_ssize_t next;   /* the next item to take (atomic) */
    int wanted;        /* helpers still to join it (under pool.lock) */
    int working;       /* helpers reading it now (under pool.lock) */
    int signalled;     /* idle helpers woken for it that have not joined one yet */
    pthread_cond_t done; /* signalled when working drops to 0 */
    struct Gang *later;  /* the next gang wanting helpers */
} Gang;

#define MAX_HELPERS MAX_ITEMS
#define HELPER_STACK (256 * 1024)

/* The helper threads, kept across calls: starting a thread and joining it
 * costs far more than waking one, and a load is one call. Helpers are started
 * on demand, at most MAX_HELPERS, and then wait on ``wake`` for a gang that
 * wants them. They never touch a Python object. */
static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    Gang *wanting;     /* gangs wanting helpers, oldest first */
    int helpers, idle;
    int starting;      /* helpers started that have not yet looked for work */
    int pending;       /* the sum of ``signalled`` over the calls reading */
    int active_calls;  /* calls of read_files now reading: they share ``threads`` */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0, 0, 0, 0};

static void
gang_work(Gang *g)
{
    Py_ssize_t i;
    while ((i = __atomic_fetch_add(&g->next, 1, __ATOMIC_RELAXED)) < g->count)
        read_item(&g->items[i]);
}

/* Remove ``g`` from pool.wanting if it is there (under pool.lock). */
static void
unlist(Gang *g)
{
    for (Gang **at = &pool.wanting; *at != NULL; at = &(*at)->later)
        if (*at == g) {
            *at = g->later;
            return;
        }
}

static void *
helper_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&pool.lock);
    pool.starting--;
    for (;;) {
        Gang *g = pool.wanting;
        if (g == NULL) {
            pool.idle++;
            pthread_cond_wait(&pool.wake, &pool.lock);
            pool.idle--;
            continue;
        }
        if (--g->wanted == 0)
            pool.wanting = g->later;
        if (g->signalled > 0) { /* one of those woken for it, or so counted */
            g->signalled--;
            pool.pending--;
        }
        g->working++;
        pthread_mutex_unlock(&pool.lock);
        gang_work(g);
        pthread_mutex_lock(&pool.lock);
        if (--g->working == 0)
            pthread_cond_signal(&g->done);
    }
    return NULL;
}

/* Start up to ``n`` more helpers (under pool.lock); a helper that cannot be
 * started leaves the work to the others. */
static void
helpers_start(int n)
{
    pthread_attr_t attr;
    if (pthread_attr_init(&attr) != 0)
        return;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, HELPER_STACK);
    /* Helpers block every signal (they inherit the mask they are started
     * with): a signal for the process goes to a thread that runs Python. */
    sigset_t all, saved;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &saved);
    for (; n > 0 && pool.helpers < MAX_HELPERS; n--) {
        pthread_t t;
        if (pthread_create(&t, &attr, helper_main, NULL) != 0)
            break;
#ifdef __linux__
        pthread_setname_np(t, "kvstore-fsio"); /* as top and py-spy show it */
#endif
        pool.helpers++;
        pool.starting++;
    }
    pthread_sigmask(SIG_SETMASK, &saved, NULL);
    pthread_attr_destroy(&attr);
}

/* The pool across fork(), registered with pthread_atfork: the forking
 * thread holds pool.lock through the fork (pool_prepare), so that the child
 * never inherits it mid-update; the parent then releases it (pool_parent).
 * A forked child has none of the parent's helpers (only the forking thread
 * survives a fork), so pool_child starts the pool afresh: gangs listed in the
 * parent belong to threads the child does not have. */
static void
pool_prepare(void)
{
    pthread_mutex_lock(&pool.lock);
}

static void
pool_parent(void)
{
    pthread_mutex_unlock(&pool.lock);
}

static void
pool_child(void)
{
    pthread_cond_init(&pool.wake, NULL);
    pool.wanting = NULL;
    pool.helpers = pool.idle = pool.starting = pool.pending = pool.active_calls = 0;
    pthread_mutex_unlock(&pool.lock); /* held by this thread since pool_prepare */
}

/* Read every item of ``g`` on up to ``threads`` threads: the caller's and
 * the pool's helpers (each file is its own open and read, so threads are
 * what overlaps them, as a disk's queue wants). The budget is divided by the
 * calls reading at the time, so concurrent loads do not multiply it. Returns
 * once every item is read and no helper holds ``g``. Runs without the GIL. */
static void
gang_run(Gang *g, int threads)
{
    pthread_mutex_lock(&pool.lock);
    int active = ++pool.active_calls;
    Py_ssize_t want = threads / active;
    if (want > g->count)
        want = g->count;
    g->wanted = (int)(want > 1 ? want - 1 : 0);
    g->working = g->signalled = 0;
    g->later = NULL;
    if (g->wanted > 0) {
        Gang **tail = &pool.wanting;
        while (*tail != NULL)
            tail = &(*tail)->later;
        *tail = g;
        /* Idle helpers already signalled for another call are not free;
         * those still starting will look at the list: start as many new
         * ones as the free ones fall short by. */
        int ready = pool.idle + pool.starting;
        int free_idle = ready > pool.pending ? ready - pool.pending : 0;
        int wake = g->wanted < free_idle ? g->wanted : free_idle;
        if (g->wanted > wake)
            helpers_start(g->wanted - wake);
        for (int i = 0; i < wake; i++)
            pthread_cond_signal(&pool.wake);
        g->signalled = wake;
        pool.pending += wake;
    }
    pthread_mutex_unlock(&pool.lock);

    gang_work(g);

    pthread_mutex_lock(&pool.lock);
    unlist(g); /* every item is taken: helpers that have not joined need not */
    pool.pending -= g->signalled; /* those woken for it and late join a later call */
    g->signalled = 0;
    while (g->working > 0)
        pthread_cond_wait(&g->done, &pool.lock);
    pool.active_calls--;
    pthread_mutex_unlock(&pool.lock);
}

/* publish_files (reading 0) and read_files (reading 1): every item with the
 * GIL released once, then per item its result or its OSError, not raised. */
static PyObject *
run_items(PyObject *items_obj, int reading, int threads, size_t piece)
{
    Item *items;
    Py_ssize_t ready;
    Py_ssize_t count = items_get(items_obj, reading, &items, &ready);
    PyObject *result = NULL;
    if (count < 0)
        goto out;
    for (Py_ssize_t i = 0; i < count; i++)
        items[i].piece = piece;

    Py_BEGIN_ALLOW_THREADS
    if (reading) {
        Gang gang = {.items = items, .count = count, .next = 0};
        pthread_cond_init(&gang.done, NULL);
        gang_run(&gang, threads);
        pthread_cond_destroy(&gang.done);
    } else {
        for (Py_ssize_t i = 0; i < count; i++) {
            Item *it = &items[i];
            Sum sum = {it->crc_of, it->crc_at, piece};
            it->err = publish_one(PyBytes_AS_STRING(it->tmp), PyBytes_AS_STRING(it->path),
                                  &it->b, it->flags, sum, &it->n, &it->failed);
        }
    }
    Py_END_ALLOW_THREADS

    result = PyList_New(count);
    for (Py_ssize_t i = 0; result != NULL && i < count; i++) {
        Item *it = &items[i];
        PyObject *value;
        if (it->err)
            value = oserror_new(it->err, it->failed);
        else if (!reading)
            value = PyLong_FromSsize_t(it->n);
        else if (it->crc_of < 0)
            value = Py_BuildValue("(nL)", (Py_ssize_t)it->n, (long long)it->size);
        else if (it->has_crc)
            value = Py_BuildValue("(nLk)", (Py_ssize_t)it->n, (long long)it->size,
                                  (unsigned long)it->crc);
        else
            value = Py_BuildValue("(nLO)", (Py_ssize_t)it->n, (long long)it->size, Py_None);
        if (value == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, i, value);
    }
out:
    items_free(items, ready);
    return result;
}

static PyObject *
publish_files(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *items_obj;
    Py_ssize_t piece = 0;
    if (!PyArg_ParseTuple(args, "O|n:publish_files", &items_obj, &piece))
        return NULL;
    if (piece < 0) {
        PyErr_SetString(PyExc_ValueError, "piece must not be negative");
        return NULL;
    }
    return run_items(items_obj, 0, 1, (size_t)piece);
}

static PyObject *
read_files(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *items_obj;
    int threads = 1;
    Py_ssize_t piece = 0;
    if (!PyArg_ParseTuple(args, "O|in:read_files", &items_obj, &threads, &piece))
        return NULL;
    if (threads < 1 || piece < 0) {
        PyErr_SetString(PyExc_ValueError, threads < 1 ? "threads must be at least 1"
                                                      : "piece must not be negative");
        return NULL;
    }
    if (threads > MAX_ITEMS)
        threads = MAX_ITEMS; /* a call reads at most MAX_ITEMS files */
    return run_items(items_obj, 1, threads, (size_t)piece);
}

static PyObject *
exists_files(PyObject *module, PyObject *paths_obj)
{
    (void)module;
    PyObject *seq = PySequence_Fast(paths_obj, "paths must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq), ready = 0;
    PyObject *result = NULL;
    PyObject **names = PyMem_Calloc((size_t)(count ? count : 1), sizeof(PyObject *));
    char *found = PyMem_Calloc((size_t)(count ? count : 1), 1);
    if (names == NULL || found == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (; ready < count; ready++)
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, ready), &names[ready]))
            goto out;

    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++)
        found[i] = access(PyBytes_AS_STRING(names[i]), F_OK) == 0;
    Py_END_ALLOW_THREADS

    result = PyList_New(count);
    for (Py_ssize_t i = 0; result != NULL && i < count; i++)
        PyList_SET_ITEM(result, i, PyBool_FromLong(found[i]));
out:
    for (Py_ssize_t i = 0; names != NULL && i < ready; i++)
        Py_XDECREF(names[i]);
    PyMem_Free(names);
    PyMem_Free(found);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"publish_file", publish_file, METH_VARARGS,
     "publish_file(tmp, path, buffers, flags[, crc_of, crc_at]) -> n: create tmp, writev, "
     "close, rename to path, with the GIL released once; with crc_of, the CRC-32C of that "
     "buffer is written little-endian at byte crc_at of the first."},
    {"publish_files", publish_files, METH_VARARGS,
     "publish_files(items, piece=0) -> list: publish_file for each (tmp, path, buffers, "
     "flags[, crc_of, crc_at]), with the GIL released once; with piece, crc_of's buffer is "
     "checksummed and written piece bytes at a time; per item bytes written (0: existed) or "
     "the OSError."},
    {"read_files", read_files, METH_VARARGS,
     "read_files(items, threads=1, piece=0) -> list: open, readv, close for each (path, "
     "buffers, flags[, crc_of]), with the GIL released once, on up to threads threads at once; "
     "with piece, crc_of's buffer is read and checksummed piece bytes at a time; per "
     "item (n, size) (with crc_of: (n, size, crc or None)) or the OSError."},
    {"exists_files", exists_files, METH_O,
     "exists_files(paths) -> list[bool]: whether each path exists (access F_OK), with the "
     "GIL released once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_fsio",
    .m_doc = "The fs tier's GIL-free per-block file I/O.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__fsio(void)
{
    crc_insn = crc_insn_present() != 0;
    static int forks_handled;
    if (!forks_handled) {
        if (pthread_atfork(pool_prepare, pool_parent, pool_child) != 0) {
            PyErr_SetString(PyExc_RuntimeError, "pthread_atfork failed");
            return NULL;
        }
        forks_handled = 1;
    }
    if (crc_insn)
        crc_span_init();
#ifdef HAVE_CRC_FOLD
    crc_fold = crc_insn && crc_fold_present();
    if (crc_fold) {
        fold_init(fold_256, 256);
        fold_init(fold_64, 64);
        fold_init(fold_16, 16);
    }
#endif
    PyObject *m = PyModule_Create(&module_def);
    /* PUBLISH_CRC: publish_files takes (crc_of, crc_at) and piece. */
    if (m != NULL && (PyModule_AddIntConstant(m, "CRC32C_INSN", crc_insn) < 0 ||
                      PyModule_AddIntConstant(m, "CRC32C_FOLD", crc_fold) < 0 ||
                      PyModule_AddIntConstant(m, "PUBLISH_CRC", crc_insn) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
