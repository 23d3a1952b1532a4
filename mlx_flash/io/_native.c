/* The FlashReader's native batch reader: a persistent pthread pool that runs
 * one batch of positioned reads (pread) into an aligned staging buffer and
 * copies each finished read's rows into their destinations, converting
 * float16/bfloat16 -> float32 (or float32/bfloat16 -> float16) on the way,
 * or dequantizing MLX's group-wise affine quantized values (see dequant()).
 *
 * Why native: a token of a 7B model needs ~12,000 reads; on 2 cores the
 * pure-Python pool spends several microseconds of GIL-held time per read,
 * which caps it below the device (reader.py has the measured figures). Here
 * Python plans the batch with a few vectorized NumPy calls and makes one call;
 * the GIL is released until every row is in place.
 *
 * One file past 500 lines: an extension module's pool, plan checks and conversions share
 * their structures.
 *
 * The plan (built and validated by plan.py, all int64):
 *   runs   R:   file offset, length to read, bytes that must arrive, offset
 *              in the shared staging buffer (lengths and offsets aligned for
 *              O_DIRECT)
 *   row_start R+1: rows of run i are row_start[i] .. row_start[i+1]-1
 *   rows   K:   byte offset of the row's bundle in its run's buffer,
 *              destination row index
 *   rows   K:   (also) the row's bundle id as the caller numbered it (the
 *              neuron id: it picks the scale table row of a quantized column)
 *   segs   S:   {offset in bundle, n values, src dtype, dst dtype,
 *              dst base address, dst row stride in bytes,
 *              and for src QUANT: bits, group size, scale dtype, scale table
 *              address (0: scales inline), bias table address, table row
 *              stride in bytes}
 * A worker takes the next run, reads it, and only if all its bytes arrived
 * converts its rows: a failed read never leaves a destination row
 * half-written. The first failure (run, errno or short count) is returned.
 *
 * Where a run lands: with slot_bytes > 0 each worker reads into its own
 * aligned slot, reused run after run (read_bundles: the rows are copied out
 * at once, and a small, hot buffer is measurably faster on our VMs than a
 * batch-sized one); with slot_bytes == 0 into the caller's staging buffer at
 * run_stage[i] (read(): the bytes are handed back).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "crc32c.h"
#include "../kernels/quant.h"

/* IEEE arithmetic, never contracted: s * q + b is a float32 multiply, then an
 * add (what MLX's CPU dequantize and NumPy compute), and float_to_half relies
 * on its separate roundings. setup.py also passes -ffp-contract=off (GCC
 * ignores this pragma; clang contracts by default, on arm64 too). */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

enum { QUANT = 3 }; /* with quant.h's F32, F16, BF16: the dtype codes of formats.py */

typedef struct {
    int64_t off, n, src, dst, dst_addr, dst_stride;
    /* src == QUANT only: bits per value, group size, dtype of scales and biases,
     * column form: the tables' addresses (row id / group of each) and row stride
     * in bytes; row form (scales_addr 0): scales and biases follow the packed values */
    int64_t bits, group, scale, scales_addr, biases_addr, table_stride;
} seg_t;

typedef struct {
    int fd;
    int64_t align, nruns, fault_off, fault_errno;
    const int64_t *run_off, *run_len, *run_need, *run_stage, *row_start;
    const int64_t *row_src, *row_dst, *row_id;
    const seg_t *segs;
    int64_t nsegs;
    /* checksums (read_bundles' checks): rows {offset in bundle, length, column}; each
     * part's CRC32C must equal crc[row_id * crc_stride + column] before any row of the
     * run is placed */
    const int64_t *checks;
    int64_t nchecks, crc_stride;
    const uint32_t *crc;
    char *stage;         /* shared staging buffer (slot_bytes == 0) */
    int64_t slot_bytes;  /* > 0: each worker reads into its own slot this big */
    int64_t next;   /* next run to take (atomic) */
    int failed;     /* set once, by the first failing run (atomic) */
    int64_t fail_run, fail_errno, fail_got;
    int active;     /* workers still on this batch (pool mutex) */
} batch_t;

/* ---- dtype conversion (branch-free, so the compiler vectorizes the loops) */

/* float -> IEEE half, round to nearest even, overflow to inf, NaN -> quiet
 * NaN (same source). Needs IEEE arithmetic: never build with -ffast-math.
 * Both functions select with bit masks, not branches, so loops vectorize. */
static inline uint16_t float_to_half(float f) {
    float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_to_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_to_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    const uint32_t is_nan = (uint32_t)0 - (uint32_t)(shl1_w > 0xFF000000u);
    return (uint16_t)((sign >> 16) | (0x7E00u & is_nan) | (nonsign & ~is_nan));
}

/* x86-64 with F16C (every x86 CPU since 2012): one instruction per 8 values,
 * ~4x the portable loop (4.3 us per 8192 halves here). Chosen at import. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define F16C_PATH 1
static int use_f16c;

__attribute__((target("avx,f16c"))) static void half_to_float_f16c(const uint16_t *s, float *d,
                                                                  int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    for (; i < n; i++) d[i] = half_to_float(s[i]);
}

__attribute__((target("avx,f16c"))) static void float_to_half_f16c(const float *s, uint16_t *d,
                                                                  int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) d[i] = float_to_half(s[i]);
}
#endif

static void convert(const char *src, int64_t sc, char *dst, int64_t dc, int64_t n) {
#ifdef F16C_PATH
    if (use_f16c && sc == F16 && dc == F32) {
        half_to_float_f16c((const uint16_t *)src, (float *)dst, n);
        return;
    }
    if (use_f16c && sc == F32 && dc == F16) {
        float_to_half_f16c((const float *)src, (uint16_t *)dst, n);
        return;
    }
#endif
    if (sc == dc) {
        memcpy(dst, src, (size_t)n * (sc == F32 ? 4 : 2));
    } else if (dc == F32) {
        const uint16_t *s = (const uint16_t *)src;
        float *d = (float *)dst;
        if (sc == F16)
            for (int64_t i = 0; i < n; i++) d[i] = half_to_float(s[i]);
        else /* BF16: the top half of a float */
            for (int64_t i = 0; i < n; i++) d[i] = f32_from_bits((uint32_t)s[i] << 16);
    } else { /* dc == F16 */
        uint16_t *d = (uint16_t *)dst;
        if (sc == F32) {
            const float *s = (const float *)src;
            for (int64_t i = 0; i < n; i++) d[i] = float_to_half(s[i]);
        } else { /* BF16 */
            const uint16_t *s = (const uint16_t *)src;
            for (int64_t i = 0; i < n; i++) d[i] = float_to_half(f32_from_bits((uint32_t)s[i] << 16));
        }
    }
}

/* ---- dequantization: MLX's group-wise affine quantization (mx.quantize)
 *
 * n values packed at `bits` bits as ONE little-endian bit stream (value j in
 * bits j*bits .. j*bits+bits-1; MLX's uint32 words viewed as bytes), each
 * w_j = scale * q_j + bias in float32 (scale and bias converted exactly).
 * Row form: the n / group scales, then the n / group biases, follow the packed
 * bytes (value j: group j / group). Column form: value j's scale and bias are
 * element j of row (id / group) of two tables in memory. Plain loops the
 * compiler vectorizes: a row group of 2, 4 or 8 bits is unpacked and scaled in
 * one pass (its size a constant), anything else unpacked to bytes, then scaled
 * (x86-64: all of it also compiled for AVX2, chosen at run time as F16C is). */

#define QCHUNK 256 /* values per column chunk; a multiple of 8 (whole bytes at any width) */
QINLINE void affine1(const uint8_t *restrict q, float s, float b, float *restrict out, int64_t m) {
    for (int64_t j = 0; j < m; j++) {
        const float t = s * (float)q[j];
        out[j] = t + b;
    }
}

QINLINE void affine_n(const uint8_t *restrict q, const float *restrict s, const float *restrict b,
                      float *restrict out, int64_t m) {
    for (int64_t j = 0; j < m; j++) {
        const float t = s[j] * (float)q[j];
        out[j] = t + b[j];
    }
}

/* one group of the row form: G values (a constant after inlining) at p -> out */
QINLINE void row_group(const uint8_t *restrict p, int64_t bits, int64_t G, float s, float b,
                       float *restrict out) {
    if (bits == 8) {
        affine1(p, s, b, out, G);
    } else if (bits == 4) { /* unpacked and scaled in one pass */
        for (int64_t i = 0; i < G / 2; i++) {
            const float lo = (float)(p[i] & 15), hi = (float)(p[i] >> 4);
            const float tl = s * lo, th = s * hi;
            out[2 * i] = tl + b;
            out[2 * i + 1] = th + b;
        }
    } else if (bits == 2) {
        for (int64_t i = 0; i < G / 4; i++)
            for (int k = 0; k < 4; k++) {
                const float t = s * (float)((p[i] >> (2 * k)) & 3);
                out[4 * i + k] = t + b;
            }
    } else {
        uint8_t q[128];
        unpack_bits(p, bits, G, q);
        affine1(q, s, b, out, G);
    }
}

/* the packed values at p (bundle + seg offset) of bundle `id` -> dst (float32 or float16) */
QINLINE void dequant_impl(const uint8_t *p, const seg_t *s, int64_t id, char *dst) {
    const int64_t bits = s->bits, n = s->n, g = s->group, ssz = s->scale == F32 ? 4 : 2;
    const int to16 = s->dst == F16;
    uint8_t q[QCHUNK];
    float tmp[QCHUNK];
    if (!s->scales_addr) { /* row form: per-group scale and bias after the packed values */
        const uint8_t *sc = p + n * bits / 8, *bi = sc + (n / g) * ssz;
        for (int64_t k = 0; k < n / g; k++) {
            const float sv = load_scale(sc + k * ssz, s->scale), bv = load_scale(bi + k * ssz, s->scale);
            const uint8_t *pk = p + k * g * bits / 8;
            float *out = to16 ? tmp : (float *)dst + k * g;
            if (g == 32) /* constant group sizes: loops the compiler unrolls */
                row_group(pk, bits, 32, sv, bv, out);
            else if (g == 64)
                row_group(pk, bits, 64, sv, bv, out);
            else
                row_group(pk, bits, 128, sv, bv, out);
            if (to16) convert((const char *)tmp, F32, dst + k * g * 2, F16, g);
        }
        return;
    }
    /* column form: value j's scale and bias are tables[id / group][j] */
    const char *srow = (const char *)(intptr_t)s->scales_addr + (id / g) * s->table_stride;
    const char *brow = (const char *)(intptr_t)s->biases_addr + (id / g) * s->table_stride;
    float sf[QCHUNK], bf[QCHUNK];
    for (int64_t j0 = 0; j0 < n; j0 += QCHUNK) {
        const int64_t m = n - j0 < QCHUNK ? n - j0 : QCHUNK;
        const float *sp = sf, *bp = bf;
        if (s->scale == F32) {
            sp = (const float *)srow + j0;
            bp = (const float *)brow + j0;
        } else {
            convert(srow + j0 * 2, s->scale, (char *)sf, F32, m);
            convert(brow + j0 * 2, s->scale, (char *)bf, F32, m);
        }
        float *out = to16 ? tmp : (float *)dst + j0;
        if (bits == 8) {
            affine_n(p + j0, sp, bp, out, m);
        } else {
            unpack_bits(p + j0 * bits / 8, bits, m, q);
            affine_n(q, sp, bp, out, m);
        }
        if (to16) convert((const char *)tmp, F32, dst + j0 * 2, F16, m);
    }
}

static void dequant_portable(const uint8_t *p, const seg_t *s, int64_t id, char *dst) {
    dequant_impl(p, s, id, dst);
}

#ifdef F16C_PATH
static int use_avx2;
/* the same code, vectorized 8 floats wide (AVX2 has no FMA: nothing to contract) */
__attribute__((target("avx2"))) static void dequant_avx2(const uint8_t *p, const seg_t *s,
                                                         int64_t id, char *dst) {
    dequant_impl(p, s, id, dst);
}
#endif

static void dequant(const uint8_t *p, const seg_t *s, int64_t id, char *dst) {
#ifdef F16C_PATH
    if (use_avx2) {
        dequant_avx2(p, s, id, dst);
        return;
    }
#endif
    dequant_portable(p, s, id, dst);
}

/* ---- one run: read it whole, then place its rows */

static void fail(batch_t *b, int64_t run, int err, int64_t got) {
    int expected = 0;
    if (__atomic_compare_exchange_n(&b->failed, &expected, 1, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE)) {
        b->fail_run = run;
        b->fail_errno = err;
        b->fail_got = got;
    }
}

static void do_run(batch_t *b, int64_t i, char *slot) {
    const int64_t off = b->run_off[i], len = b->run_len[i], need = b->run_need[i];
    char *buf = slot ? slot : b->stage + b->run_stage[i];
    int64_t got = 0;
    int err = 0;
    if (b->fault_off >= off && b->fault_off < off + len) {
        err = (int)b->fault_errno; /* injected by tests */
    } else {
        while (got < need) {
            ssize_t r = pread(b->fd, buf + got, (size_t)(len - got), (off_t)(off + got));
            if (r < 0) {
                if (errno == EINTR) continue;
                err = errno;
                break;
            }
            if (r == 0) break; /* end of file */
            got += r;
            if (got % b->align) break; /* an unaligned end is the end of the file */
        }
    }
    if (err || got < need) {
        fail(b, i, err, got);
        return;
    }
    for (int64_t k = b->row_start[i]; b->nchecks && k < b->row_start[i + 1]; k++) {
        const char *bundle = buf + b->row_src[k];
        for (int64_t c = 0; c < b->nchecks; c++) {
            const int64_t *ck = b->checks + 3 * c;
            if (crc32c_update(0, bundle + ck[0], (size_t)ck[1]) !=
                b->crc[b->row_id[k] * b->crc_stride + ck[2]]) {
                fail(b, i, EBADMSG, k * b->nchecks + c); /* got: which row and check */
                return;
            }
        }
    }
    for (int64_t k = b->row_start[i]; k < b->row_start[i + 1]; k++) {
        const char *bundle = buf + b->row_src[k];
        for (int64_t j = 0; j < b->nsegs; j++) {
            const seg_t *s = &b->segs[j];
            char *dst = (char *)(intptr_t)s->dst_addr + b->row_dst[k] * s->dst_stride;
            if (s->src == QUANT)
                dequant((const uint8_t *)bundle + s->off, s, b->row_id ? b->row_id[k] : 0, dst);
            else
                convert(bundle + s->off, s->src, dst, s->dst, s->n);
        }
    }
}

/* a worker's own staging slot, page-aligned, kept from batch to batch */
typedef struct {
    void *pool;
    char *buf;
    int64_t size;
} slot_t;

static void work_on(batch_t *b, slot_t *s) {
    char *buf = NULL;
    if (b->slot_bytes > 0) {
        if (s->size < b->slot_bytes) {
            free(s->buf);
            s->buf = NULL;
            s->size = 0;
            if (posix_memalign((void **)&s->buf, 4096, (size_t)b->slot_bytes)) {
                s->buf = NULL;
                fail(b, -1, ENOMEM, 0);
                return;
            }
            s->size = b->slot_bytes;
        }
        buf = s->buf;
    }
    for (;;) {
        if (__atomic_load_n(&b->failed, __ATOMIC_ACQUIRE)) return; /* fail fast */
        int64_t i = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED);
        if (i >= b->nruns) return;
        do_run(b, i, buf);
    }
}

/* ---- the pool: workers sleep on `work` until the caller hands out tickets */

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    pthread_t *threads;
    slot_t *slots;
    int nthreads, started, tickets, stop;
    pid_t pid; /* threads do not survive fork(): a child must make its own pool */
    batch_t *batch;
} Pool;

static void *worker(void *arg) {
    slot_t *slot = (slot_t *)arg;
    Pool *p = (Pool *)slot->pool;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->tickets == 0) pthread_cond_wait(&p->work, &p->mu);
        if (p->tickets == 0) break; /* stopping: but a batch in flight is finished first */
        p->tickets--;
        batch_t *b = p->batch;
        pthread_mutex_unlock(&p->mu);
        work_on(b, slot);
        pthread_mutex_lock(&p->mu);
        if (--b->active == 0) pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    free(slot->buf);
    slot->buf = NULL;
    return NULL;
}

static void pool_stop(Pool *p) {
    if (!p->threads) return;
    if (p->pid == getpid()) {
        pthread_mutex_lock(&p->mu);
        p->stop = 1;
        pthread_cond_broadcast(&p->work);
        pthread_mutex_unlock(&p->mu);
        for (int t = 0; t < p->started; t++) pthread_join(p->threads[t], NULL);
    } /* else a forked child: the threads are not ours to join */
    /* the Raw allocator: Pool_close calls this with the GIL released, and
     * PyMem_Free without the GIL crashes on Python 3.12+ */
    PyMem_RawFree(p->threads);
    PyMem_RawFree(p->slots);
    p->threads = NULL;
    p->slots = NULL;
    p->started = 0;
}

static int Pool_init(Pool *self, PyObject *args, PyObject *kw) {
    int n;
    if (!PyArg_ParseTuple(args, "i", &n)) return -1;
    if (n < 1 || n > 1024) {
        PyErr_SetString(PyExc_ValueError, "threads must be in 1..1024");
        return -1;
    }
    if (self->threads) {
        PyErr_SetString(PyExc_RuntimeError, "Pool already initialized");
        return -1;
    }
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->work, NULL);
    pthread_cond_init(&self->done, NULL);
    self->threads = PyMem_RawCalloc((size_t)n, sizeof(pthread_t));
    self->slots = PyMem_RawCalloc((size_t)n, sizeof(slot_t));
    if (!self->threads || !self->slots) {
        PyMem_RawFree(self->threads);
        PyMem_RawFree(self->slots);
        self->threads = NULL;
        self->slots = NULL;
        PyErr_NoMemory();
        return -1;
    }
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024); /* workers need little stack */
    self->nthreads = n;
    self->pid = getpid();
    for (int t = 0; t < n; t++) {
        self->slots[t].pool = self;
        int rc = pthread_create(&self->threads[t], &attr, worker, &self->slots[t]);
        if (rc) {
            pthread_attr_destroy(&attr);
            pool_stop(self);
            errno = rc;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        self->started++;
    }
    pthread_attr_destroy(&attr);
    return 0;
}

static void Pool_dealloc(Pool *self) {
    pool_stop(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Pool_close(Pool *self, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    pool_stop(self);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static int64_t *int64s(Py_buffer *v, int64_t count, const char *name) {
    if (v->len < count * 8) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, need %lld", name, v->len, (long long)count * 8);
        return NULL;
    }
    return (int64_t *)v->buf;
}

/* run(fd, align, nruns, run_off, run_len, run_need, run_stage, row_start,
 *     row_src, row_dst, row_id, segs, stage, slot_bytes, fault_off, fault_errno)
 * -> None, or (failed run index (-1: none), errno (0 = short read), bytes that arrived)
 * row_id: each row's bundle id (int64, rows' order), needed by quantized
 * column segments only (may be empty otherwise) */
static PyObject *Pool_run(Pool *self, PyObject *args) {
    batch_t b;
    memset(&b, 0, sizeof b);
    Py_buffer v[12];
    long long align, nruns, slot_bytes, fault_off, fault_errno, crc_stride;
    if (!PyArg_ParseTuple(args, "iLLy*y*y*y*y*y*y*y*y*w*LLLy*y*L", &b.fd, &align, &nruns, &v[0], &v[1],
                          &v[2], &v[3], &v[4], &v[5], &v[6], &v[7], &v[8], &v[9], &slot_bytes,
                          &fault_off, &fault_errno, &v[10], &v[11], &crc_stride))
        return NULL;
    b.checks = (const int64_t *)v[10].buf;
    b.nchecks = v[10].len / 24;
    b.crc = (const uint32_t *)v[11].buf;
    b.crc_stride = crc_stride;
    b.slot_bytes = slot_bytes;
    b.align = align;
    b.nruns = nruns;
    b.fault_off = fault_off;
    b.fault_errno = fault_errno;
    PyObject *result = NULL;
    int64_t nrows = 0;
    int busy = 0, need_ids = 0;
    if (!self->threads || self->pid != getpid()) {
        PyErr_SetString(PyExc_RuntimeError, "Pool is closed (or was inherited by fork)");
        goto out;
    }
    if (b.align < 1 || b.nruns < 0) {
        PyErr_SetString(PyExc_ValueError, "bad align or nruns");
        goto out;
    }
    if (!(b.run_off = int64s(&v[0], b.nruns, "run_off")) ||
        !(b.run_len = int64s(&v[1], b.nruns, "run_len")) ||
        !(b.run_need = int64s(&v[2], b.nruns, "run_need")) ||
        !(b.run_stage = int64s(&v[3], b.nruns, "run_stage")) ||
        !(b.row_start = int64s(&v[4], b.nruns + 1, "row_start")))
        goto out;
    nrows = b.nruns ? b.row_start[b.nruns] : 0;
    if (v[8].len % (Py_ssize_t)sizeof(seg_t)) {
        PyErr_Format(PyExc_ValueError, "segs: %zd bytes, not rows of %d int64",
                     v[8].len, (int)(sizeof(seg_t) / 8));
        goto out;
    }
    b.segs = (const seg_t *)v[8].buf;
    b.nsegs = v[8].len / (Py_ssize_t)sizeof(seg_t);
    for (int64_t j = 0; j < b.nsegs; j++) { /* the rest is checked in Python */
        const seg_t *s = &b.segs[j];
        if (s->src != QUANT) continue;
        int ok = (s->bits == 2 || s->bits == 3 || s->bits == 4 || s->bits == 5 || s->bits == 6 ||
                  s->bits == 8) &&
                 (s->group == 32 || s->group == 64 || s->group == 128) && s->scale >= F32 &&
                 s->scale <= BF16 && s->n >= 0 && (s->n * s->bits) % 8 == 0 &&
                 (s->scales_addr ? s->biases_addr != 0 : s->n % s->group == 0);
        if (!ok) {
            PyErr_Format(PyExc_ValueError, "segment %lld: bad quantization parameters", (long long)j);
            goto out;
        }
        need_ids |= s->scales_addr != 0;
    }
    need_ids |= b.nchecks > 0; /* (the table's size against the ids is checked in Python) */
    if (!(b.row_src = int64s(&v[5], nrows, "row_src")) ||
        (b.nsegs && !(b.row_dst = int64s(&v[6], nrows, "row_dst"))) ||
        (need_ids && !(b.row_id = int64s(&v[7], nrows, "row_id"))))
        goto out;
    b.stage = (char *)v[9].buf;
    /* every run must fit its buffer (the rows are checked in Python) */
    for (int64_t i = 0; i < b.nruns; i++) {
        int fits = b.run_len[i] >= b.run_need[i] &&
                   (b.slot_bytes > 0 ? b.run_len[i] <= b.slot_bytes
                                     : b.run_stage[i] >= 0 && b.run_stage[i] + b.run_len[i] <= v[9].len);
        if (!fits) {
            PyErr_Format(PyExc_ValueError, "run %lld does not fit its staging buffer", (long long)i);
            goto out;
        }
    }
    if (b.nruns == 0) {
        result = Py_None;
        Py_INCREF(result);
        goto out;
    }

    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    if (self->batch) {
        busy = 1;
    } else {
        int n = b.nruns < self->nthreads ? (int)b.nruns : self->nthreads;
        self->batch = &b;
        b.active = n;
        self->tickets = n;
        for (int t = 0; t < n; t++) pthread_cond_signal(&self->work);
        while (b.active > 0) pthread_cond_wait(&self->done, &self->mu);
        self->batch = NULL;
    }
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    if (busy) {
        PyErr_SetString(PyExc_RuntimeError, "Pool.run called concurrently");
        goto out;
    }
    if (b.failed)
        result = Py_BuildValue("LLL", (long long)b.fail_run, (long long)b.fail_errno,
                               (long long)b.fail_got);
    else {
        result = Py_None;
        Py_INCREF(result);
    }
out:
    for (int i = 0; i < 12; i++) PyBuffer_Release(&v[i]);
    return result;
}

/* crc32c(data, crc=0) -> CRC32C of a bytes-like, continuing crc */
static PyObject *py_crc32c(PyObject *mod, PyObject *args) {
    Py_buffer d;
    unsigned int crc = 0;
    (void)mod;
    if (!PyArg_ParseTuple(args, "y*|I", &d, &crc)) return NULL;
    uint32_t r;
    Py_BEGIN_ALLOW_THREADS
    r = crc32c_update(crc, d.buf, (size_t)d.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&d);
    return PyLong_FromUnsignedLong(r);
}

/* crc32c_rows(rows, row_bytes, off, n, out, crc): out[k] = CRC32C of bytes off..off+n-1 of
 * row k (a uint32 array with one entry per row) */
static PyObject *py_crc32c_rows(PyObject *mod, PyObject *args) {
    Py_buffer r, o;
    long long row_bytes, off, n;
    unsigned int crc = 0;
    (void)mod;
    if (!PyArg_ParseTuple(args, "y*LLLw*|I", &r, &row_bytes, &off, &n, &o, &crc)) return NULL;
    int64_t rows = o.len / 4;
    if (row_bytes <= 0 || off < 0 || n < 0 || off + n > row_bytes || rows * row_bytes > r.len) {
        PyBuffer_Release(&r);
        PyBuffer_Release(&o);
        PyErr_SetString(PyExc_ValueError, "crc32c_rows: parts outside the rows");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (int64_t k = 0; k < rows; k++)
        ((uint32_t *)o.buf)[k] = crc32c_update(crc, (const char *)r.buf + k * row_bytes + off, (size_t)n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&r);
    PyBuffer_Release(&o);
    Py_RETURN_NONE;
}

/* crc32c_hardware(flag) -> 1 (the CRC instruction) or 0 (the table): set on/off, -1 queries */
static PyObject *py_crc32c_hardware(PyObject *mod, PyObject *args) {
    int flag;
    (void)mod;
    if (!PyArg_ParseTuple(args, "i", &flag)) return NULL;
    return PyLong_FromLong(crc32c_hardware(flag)); /* 0 or 1: the path crc32c_update takes */
}

/* convert(src, src_code, dst, dst_code, n): the conversion alone, for tests */
static PyObject *py_convert(PyObject *mod, PyObject *args) {
    Py_buffer s, d;
    long long sc, dc, n;
    (void)mod;
    if (!PyArg_ParseTuple(args, "y*Lw*LL", &s, &sc, &d, &dc, &n)) return NULL;
    int64_t ss = sc == F32 ? 4 : 2, ds = dc == F32 ? 4 : 2;
    if (sc < F32 || sc > BF16 || (dc != F32 && dc != F16) || n < 0 || s.len < n * ss ||
        d.len < n * ds) {
        PyBuffer_Release(&s);
        PyBuffer_Release(&d);
        PyErr_SetString(PyExc_ValueError, "bad convert arguments");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS /* a prefetch worker converts while the main thread computes */
    convert((const char *)s.buf, sc, (char *)d.buf, dc, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    Py_RETURN_NONE;
}

/* dequantize(src, n, bits, group, scale_code, scales, biases, dst, dst_code): one
 * quantized row, the segment code alone (tests, micro-benchmarks). scales and
 * biases None: the row form (scales and biases follow the packed bytes in src); else
 * the column form, buffers of the n scales and n biases of this row (a table row). */
static PyObject *py_dequantize(PyObject *mod, PyObject *args) {
    Py_buffer src, d, sb[2];
    PyObject *tables[2];
    long long n, bits, group, sc, dc;
    (void)mod;
    if (!PyArg_ParseTuple(args, "y*LLLLOOw*L", &src, &n, &bits, &group, &sc, &tables[0],
                          &tables[1], &d, &dc))
        return NULL;
    int have = 0;
    PyObject *result = NULL;
    const int64_t ssz = sc == F32 ? 4 : 2;
    seg_t s;
    memset(&s, 0, sizeof s);
    s.n = n, s.src = QUANT, s.dst = dc, s.bits = bits, s.group = group, s.scale = sc;
    int ok = (bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8) &&
             (group == 32 || group == 64 || group == 128) && sc >= F32 && sc <= BF16 &&
             (dc == F32 || dc == F16) && n >= 0 && (n * bits) % 8 == 0 &&
             d.len >= n * (dc == F32 ? 4 : 2);
    if (ok && tables[0] == Py_None && tables[1] == Py_None) {
        ok = n % group == 0 && src.len >= n * bits / 8 + 2 * (n / group) * ssz;
    } else if (ok) {
        for (; have < 2; have++)
            if (PyObject_GetBuffer(tables[have], &sb[have], PyBUF_SIMPLE) < 0) goto out;
        ok = src.len >= n * bits / 8 && sb[0].len >= n * ssz && sb[1].len >= n * ssz;
        s.scales_addr = (int64_t)(intptr_t)sb[0].buf;
        s.biases_addr = (int64_t)(intptr_t)sb[1].buf;
    }
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "bad dequantize arguments");
        goto out;
    }
    Py_BEGIN_ALLOW_THREADS
    dequant((const uint8_t *)src.buf, &s, 0, (char *)d.buf);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
out:
    for (int i = 0; i < have; i++) PyBuffer_Release(&sb[i]);
    PyBuffer_Release(&src);
    PyBuffer_Release(&d);
    return result;
}

/* move_rows(buf, row_bytes, dst_rows, src_rows): row src_rows[i] of buf onto row dst_rows[i]
 * (int64 arrays; the two sets disjoint), one memmove each, GIL released: the neuron
 * cache's swap-delete without NumPy's gather-then-scatter temporary */
static PyObject *py_move_rows(PyObject *mod, PyObject *args) {
    Py_buffer b, d, s;
    long long row_bytes;
    (void)mod;
    if (!PyArg_ParseTuple(args, "w*Ly*y*", &b, &row_bytes, &d, &s)) return NULL;
    PyObject *result = NULL;
    int64_t n = (int64_t)(d.len / 8), rows = row_bytes > 0 ? (int64_t)(b.len / row_bytes) : 0;
    const int64_t *dst = (const int64_t *)d.buf, *src = (const int64_t *)s.buf;
    if (row_bytes <= 0 || d.len != s.len || d.len % 8) {
        PyErr_SetString(PyExc_ValueError, "bad move_rows arguments");
        goto out;
    }
    for (int64_t i = 0; i < n; i++)
        if (dst[i] < 0 || dst[i] >= rows || src[i] < 0 || src[i] >= rows) {
            PyErr_SetString(PyExc_IndexError, "move_rows: row out of range");
            goto out;
        }
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++)
        memmove((char *)b.buf + dst[i] * row_bytes, (char *)b.buf + src[i] * row_bytes, (size_t)row_bytes);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
out:
    PyBuffer_Release(&b);
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    return result;
}

static PyMethodDef Pool_methods[] = {
    {"run", (PyCFunction)Pool_run, METH_VARARGS, "run one batch (see _native.c)"},
    {"close", (PyCFunction)Pool_close, METH_NOARGS, "stop and join the worker threads"},
    {NULL}};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mlx_flash.io._native.Pool",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pool(threads): persistent pthread pool for batches of positioned reads",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
};

/* simd(flag) -> bool: use F16C and AVX2 (those the CPU has); flag < 0 only asks */
static PyObject *py_simd(PyObject *mod, PyObject *args) {
    int flag;
    (void)mod;
    if (!PyArg_ParseTuple(args, "i", &flag)) return NULL;
#ifdef F16C_PATH
    if (flag >= 0) {
        use_f16c = flag && __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
        use_avx2 = flag && __builtin_cpu_supports("avx2");
    }
    return PyBool_FromLong(use_f16c || use_avx2);
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef module_methods[] = {
    {"convert", py_convert, METH_VARARGS, "convert(src, src_code, dst, dst_code, n)"},
    {"dequantize", py_dequantize, METH_VARARGS,
     "dequantize(src, n, bits, group, scale_code, scales, biases, dst, dst_code)"},
    {"move_rows", py_move_rows, METH_VARARGS, "move_rows(buf, row_bytes, dst_rows, src_rows)"},
    {"simd", py_simd, METH_VARARGS, "simd(flag) -> bool: F16C / AVX2 code on/off (-1: query)"},
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(data, crc=0) -> int"},
    {"crc32c_rows", py_crc32c_rows, METH_VARARGS, "crc32c_rows(rows, row_bytes, off, n, out, crc=0)"},
    {"crc32c_hardware", py_crc32c_hardware, METH_VARARGS, "crc32c_hardware(flag) -> 1 (instruction) or 0 (table); -1: query"},
    {NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "native batch reader for mlx_flash.io", -1, module_methods};

PyMODINIT_FUNC PyInit__native(void) {
#ifdef F16C_PATH
    __builtin_cpu_init();
    use_f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
    crc32c_hardware(-1); /* choose the CRC32C path and build its table now, under the GIL */
    if (PyType_Ready(&PoolType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(m, "Pool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(&PoolType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
