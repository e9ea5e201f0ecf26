/* tests/c/test_kernels.c -- the C kernels of include/pagedkv/ on every SIMD
 * path this build and CPU can run, against a plain C reference.
 *
 * Covered: the row conversions into bfloat16, float16 and int8 against their
 * scalar rules, token writes into the pool (checked byte for byte against the
 * documented layout, untouched bytes included), reads back, the sequence
 * check, the vector exp, paged decode and causal prefill with and without
 * RoPE, each with and without a sliding window, logit softcapping and
 * learned sinks (in random combination), and the row-batch linear kernel
 * (linear.h: y = x W^T + b), over random shapes: block sizes
 * 1..64, head_dim odd and even, GQA
 * ratios, 1..3 layers, lengths ending mid-block, StreamingLLM segments (a gap
 * of evicted slots), 1 and 2 threads (split-K included).  Unwritten and
 * evicted slots and the output hold NaN before a call, so a kernel that reads
 * what it must not, or leaves an output unwritten, fails.
 *
 * Tolerances (as tests/reference.py): |out - ref| <= rtol * |ref| +
 * rtol * max|v| (plus (keys of a tile) / 65534 * max|v| where the int8
 * values' P.V rounds the weights to int16: pkv_quantizes_weights), rtol 1e-5 for f32 and 1e-12 for f64; the reference runs
 * in double.  The AVX-512 + VNNI path scores int8 keys (float32 compute,
 * no RoPE, blocks of at least 16 keys) against the query quantized per group
 * of 32 dimensions (attn_dot.h), and the AVX-512 + BF16 path scores
 * bfloat16 keys the same way against the query rounded to bfloat16
 * (attn_bf16dot.h): their references replay that rounding, to the same
 * tolerance.
 *
 * Usage: test_kernels [--trials N] [--seed S] [--require PATH]...
 * Exit status 0 when every check passed and every required path ran.
 * The random pools and their layout checks: fixture.c.  Built and run by
 * tests/c/run.sh (natively, and for aarch64 under qemu).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fixture.h"
#include "pagedkv/attention.h"
#include "pagedkv/linear.h"

static const char *const simd_names[PKV_NUM_SIMD] = PKV_SIMD_NAMES;

/* ---- reference attention -------------------------------------------------- */

/* x rotated (rotate-half, first 2*half dims) to position pos, in double,
 * from the same cos/sin tables the kernels read */
static void ref_rope(const config *c, double *x, int64_t pos) {
    for (int i = 0; i < c->rope_half; i++) {
        const double cs = get(c->cos, (size_t)pos * c->rope_half + i, c->dt);
        const double sn = get(c->sin, (size_t)pos * c->rope_half + i, c->dt);
        const double x0 = x[i], x1 = x[i + c->rope_half];
        x[i] = x0 * cs - x1 * sn;
        x[i + c->rope_half] = x1 * cs + x0 * sn;
    }
}

/* sequence s's keys on `layer` in double, rotated by RoPE to their ranks:
 * [held][hkv][d] */
static double *ref_keys(const config *c, int s, int layer) {
    const size_t tok = (size_t)c->hkv * c->d, held = (size_t)held_of(c, s);
    double *k = malloc(sizeof(double) * (held * tok + 1));
    for (size_t i = 0; i < held * tok; i++) k[i] = get(c->kref[s], layer * held * tok + i, c->dt);
    if (c->rope_half)
        for (size_t r = 0; r < held; r++)
            for (int h = 0; h < c->hkv; h++) ref_rope(c, k + r * tok + (size_t)h * c->d, (int64_t)r);
    return k;
}

/* attention options of one check (0 / NULL: off) */
typedef struct {
    int64_t window;
    double softcap;
    double *sinks; /* [hq] */
} opts_t;

/* A float32 query vector as the integer-dot kernels see it (attn_dot.h):
 * per group of 32 dimensions rounded to int8 steps of max |x| / 127 (the
 * softmax scale applies to the scores afterwards); qv becomes the quantized
 * values times their scales. */
static void quantize_query(double *qv, int d) {
    for (int i0 = 0; i0 < d; i0 += PKV_I8_GROUP) {
        const int i1 = d - i0 < PKV_I8_GROUP ? d : i0 + PKV_I8_GROUP;
        float amax = 0.0f;
        for (int i = i0; i < i1; i++) {
            qv[i] = (double)(float)qv[i];
            if (fabsf((float)qv[i]) > amax) amax = fabsf((float)qv[i]);
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, qs = amax / 127.0f;
        for (int i = i0; i < i1; i++) qv[i] = (double)nearbyintf((float)qv[i] * inv) * (double)qs;
    }
}

/* 1 when path simd scores the keys of (storage, compute) against a rounded
 * query: int8 steps (quantize_query) or bfloat16 (round_query_bf16) */
static int rounds_query(int st, int dt, int simd, int bs, int rope) {
    return pkv_quantizes_queries(st, dt, simd, bs, rope) || pkv_rounds_queries_bf16(st, dt, simd, bs, rope);
}

/* A float32 query vector rounded to bfloat16, to nearest even (attn_bf16dot.h) */
static void round_query_bf16(double *qv, int d) {
    for (int i = 0; i < d; i++) qv[i] = (double)pkv_bf16_to_f32(pkv_f32_to_bf16((float)qv[i]));
}

/* out [hq][d] for query q [hq][d] (at element qoff) of sequence s at rank
 * lim (sees ranks 0..lim, or (lim - window, lim]) with keys k from ref_keys;
 * *vmax = max |v| over what it reads.  quant: the query as the paths of
 * rounds_query see it (quantize_query for int8 keys, round_query_bf16 for
 * bfloat16 keys). */
static void ref_one(const config *c, int s, int layer, const double *k, const void *q, size_t qoff,
                    int64_t lim, double scale, const opts_t *o, int quant, double *out, double *vmax) {
    const int d = c->d, gsz = c->hq / c->hkv;
    const size_t tok = (size_t)c->hkv * d, base = (size_t)layer * held_of(c, s) * tok;
    double *qv = malloc(sizeof(double) * d);
    double *p = malloc(sizeof(double) * (size_t)(lim + 1));
    for (int h = 0; h < c->hq; h++) {
        const int kh = h / gsz;
        for (int j = 0; j < d; j++) qv[j] = get(q, qoff + (size_t)h * d + j, c->dt);
        if (c->rope_half) ref_rope(c, qv, lim);
        if (quant && c->st == PKV_BF16) round_query_bf16(qv, d);
        else if (quant) quantize_query(qv, d);
        double mx = -INFINITY;
        const int64_t lo = o->window > 0 && lim - o->window + 1 > 0 ? lim - o->window + 1 : 0;
        for (int64_t r = lo; r <= lim; r++) {
            const double *kv = k + (size_t)r * tok + (size_t)kh * d;
            double sc = 0;
            for (int j = 0; j < d; j++) sc += qv[j] * kv[j];
            p[r] = sc * scale;
            if (o->softcap > 0) p[r] = o->softcap * tanh(p[r] / o->softcap);
            if (p[r] > mx) mx = p[r];
        }
        if (o->sinks && o->sinks[h] > mx) mx = o->sinks[h];
        double sum = o->sinks ? exp(o->sinks[h] - mx) : 0;
        for (int64_t r = lo; r <= lim; r++) sum += p[r] = exp(p[r] - mx);
        for (int j = 0; j < d; j++) out[(size_t)h * d + j] = 0;
        for (int64_t r = lo; r <= lim; r++) {
            const size_t vo = base + (size_t)r * tok + (size_t)kh * d;
            for (int j = 0; j < d; j++) {
                const double vv = get(c->vref[s], vo + j, c->dt);
                out[(size_t)h * d + j] += p[r] * vv;
                if (fabs(vv) > *vmax) *vmax = fabs(vv);
            }
        }
        for (int j = 0; j < d; j++) out[(size_t)h * d + j] /= sum;
    }
    free(qv);
    free(p);
}

static double rtol_of(int dt) { return dt == PKV_F64 ? 1e-12 : 1e-5; }

/* Where path simd rounds the attention weights to int16 for P.V of int8
 * values (pkv_quantizes_weights, attn_pvdot.h), the bound that rounding
 * adds, as a fraction of max|v|: (keys of a tile) / 65534, decode's and
 * prefill's tile there being PKV_I16_TILE_KEYS */
static double weights_tol(const config *c, int simd) {
    return pkv_quantizes_weights(c->st, c->dt, simd) ? pkv_tile_blocks(c->bs, PKV_I16_TILE_KEYS) * c->bs / 65534.0 : 0.0;
}

/* compare n outputs of path simd against the reference; returns the worst
 * error / bound */
static double compare(const config *c, int simd, const void *out, size_t off, const double *ref,
                      size_t n, double vmax) {
    const double rtol = rtol_of(c->dt), vtol = rtol + weights_tol(c, simd);
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        const double x = get(out, off + i, c->dt);
        const double bound = rtol * fabs(ref[i]) + vtol * vmax;
        const double err = fabs(x - ref[i]);
        if (!(err <= bound)) return INFINITY; /* NaN included */
        if (bound > 0 && (double)(err / bound) > worst) worst = (double)(err / bound);
    }
    return worst;
}

/* the (storage, compute) pairs the kernel table builds */
static const int pairs[][2] = {{PKV_F32, PKV_F32}, {PKV_F64, PKV_F64}, {PKV_F32, PKV_F64},
                               {PKV_BF16, PKV_F32}, {PKV_BF16, PKV_F64}, {PKV_F16, PKV_F32},
                               {PKV_F16, PKV_F64}, {PKV_I8, PKV_F32},   {PKV_I8, PKV_F64}};
#define NPAIRS ((int)(sizeof pairs / sizeof *pairs))
static const char *const dtype_names[PKV_NUM_DTYPES] = {"f32", "f64", "bf16", "f16", "i8"};

typedef struct {
    long cases[PKV_NUM_SIMD];
    long threaded, split; /* decode calls that ran on 2 threads; that split keys */
    double worst[PKV_NUM_SIMD][NPAIRS]; /* per (storage, compute): worst error / bound */
    long pair_cases[PKV_NUM_SIMD][NPAIRS];
    long cases16[PKV_NUM_SIMD];         /* 16-bit q/out calls checked bit for bit */
} tally;

static void fill_args(const config *c, pkv_attn_args *a, int layer, const void *q, void *out,
                      double scale, int nthreads, void *scratch, size_t stride, void *partial,
                      int64_t partial_slots, pkv_rope *rope) {
    memset(a, 0, sizeof *a);
    const size_t koff = pkv_k_offset(&c->g, layer);
    a->k = c->arena + koff;
    a->v = c->arena + koff + c->g.plane_bytes;
    a->block_stride = c->g.block_bytes;
    a->scale_offset = c->g.scale_offset;
    a->bs = c->bs;
    a->hkv = c->hkv;
    a->hq = c->hq;
    a->d = c->d;
    a->tables = (const int32_t *const *)c->tables;
    a->segs = c->segs;
    a->q = q;
    a->out = out;
    a->scale = scale;
    a->rope = NULL;
    if (c->rope_half) {
        rope->cos = c->cos;
        rope->sin = c->sin;
        rope->cos_t = c->cos_t;
        rope->sin_t = c->sin_t;
        rope->max_pos = c->max_pos;
        rope->half = c->rope_half;
        a->rope = rope;
    }
    a->scratch = scratch;
    a->scratch_stride = stride;
    a->partial = partial;
    a->partial_slots = partial_slots;
    a->nthreads = nthreads;
}

/* decode (all sequences) and prefill (each sequence's newest n ranks) on
 * every path, with 1 and 2 threads */
/* 16-bit queries and output (a->qo16) on float32 compute: the output must be, bit for bit,
 * the float32 kernel's over the widened queries, rounded once.  `a` is a filled prefill (or
 * decode) call over float32 queries; its q is replaced by rounded 16-bit copies. */
static void check_qo16(const config *c, const pkv_kernels *kern, const pkv_attn_args *a0, int simd,
                       int fmt) {
    const int prefill = a0->nq > 1 || a0->nseq == 1;
    const size_t n = (size_t)(prefill ? a0->nq : a0->nseq) * c->hq * c->d;
    uint16_t *q16 = xalloc(n * 2), *o16 = xalloc(n * 2);
    float *qw = xalloc(n * 4), *o32 = xalloc(n * 4);
    for (size_t i = 0; i < n; i++) {
        const float x = ((const float *)a0->q)[i];
        q16[i] = fmt == PKV_BF16 ? pkv_f32_to_bf16(x) : pkv_f32_to_f16(x);
        qw[i] = fmt == PKV_BF16 ? pkv_bf16_to_f32(q16[i]) : pkv_f16_to_f32(q16[i]);
    }
    pkv_attn_args a = *a0;
    a.q = qw;
    a.out = o32;
    a.qo16 = 0;
    if (prefill) kern->prefill(&a); else kern->decode(&a);
    a.q = q16;
    a.out = o16;
    a.qo16 = fmt;
    if (prefill) kern->prefill(&a); else kern->decode(&a);
    long bad = 0;
    for (size_t i = 0; i < n; i++) {
        const uint16_t want = fmt == PKV_BF16 ? pkv_f32_to_bf16(o32[i]) : pkv_f32_to_f16(o32[i]);
        bad += o16[i] != want;
    }
    CHECK(bad == 0, "%s 16-bit (%s) q/out %s: %ld of %zu values differ from the float32 result "
          "rounded (bs=%d d=%d hkv=%d hq=%d)", simd_names[simd], fmt == PKV_BF16 ? "bf16" : "f16",
          prefill ? "prefill" : "decode", bad, n, c->bs, c->d, c->hkv, c->hq);
    free(q16);
    free(o16);
    free(qw);
    free(o32);
}

static void check_attention(const config *c, tally *t, int pair, int big) {
    const int d = c->d, dt = c->dt;
    const size_t row = (size_t)c->hq * d;
    const int layer = rnd_int(0, c->layers - 1);
    const double scale = rnd_int(0, 1) ? 1.0 / sqrt((double)d) : 0.05 + rnd_unif();
    const int max_threads = pkv_have_openmp() ? 2 : 1;
    /* options: a sliding window, softcapping, learned sinks, each in half the checks */
    opts_t o = {0, 0.0, NULL};
    int64_t held_max = 1;
    for (int s = 0; s < c->nseq; s++)
        if (held_of(c, s) > held_max) held_max = held_of(c, s);
    if (rnd_int(0, 1)) o.window = rnd_int(1, (int)held_max + 2);
    if (rnd_int(0, 1)) o.softcap = 0.2 + 10 * rnd_unif();
    double *sinks = malloc(sizeof(double) * c->hq);
    for (int h = 0; h < c->hq; h++) sinks[h] = 2 * rnd_normal();
    if (rnd_int(0, 1)) o.sinks = sinks;

    /* references; [1]: the rounded query, for the paths that score int8 keys
     * with an integer dot product (attn_dot.h) or bfloat16 keys with vdpbf16ps
     * (attn_bf16dot.h): float32 compute, no RoPE, blocks of at least one
     * vector of keys */
    int qdot = 0;
    for (int simd = 0; simd < PKV_NUM_SIMD; simd++)
        qdot |= rounds_query(c->st, dt, simd, c->bs, c->rope_half);
    void *qd = xalloc((size_t)c->nseq * row * c->item);
    for (size_t i = 0; i < (size_t)c->nseq * row; i++) put(qd, i, dt, rnd_normal());
    double *refd[2] = {malloc(sizeof(double) * (size_t)c->nseq * row),
                       malloc(sizeof(double) * (size_t)c->nseq * row)};
    double vmaxd = 0;
    for (int s = 0; s < c->nseq; s++) {
        double *k = ref_keys(c, s, layer);
        for (int qz = 0; qz <= qdot; qz++)
            ref_one(c, s, layer, k, qd, (size_t)s * row, held_of(c, s) - 1, scale, &o, qz,
                    refd[qz] + (size_t)s * row, &vmaxd);
        free(k);
    }
    const int ps = rnd_int(0, c->nseq - 1); /* prefill: one sequence */
    const int64_t held = held_of(c, ps);
    const int max_nq = big ? 8 : 40; /* big: for the split decode; spare the emulator */
    const int64_t nq = rnd_int(1, held < max_nq ? (int)held : max_nq);
    void *qp = xalloc((size_t)nq * row * c->item);
    for (size_t i = 0; i < (size_t)nq * row; i++) put(qp, i, dt, rnd_normal());
    double *refp[2] = {malloc(sizeof(double) * (size_t)nq * row), malloc(sizeof(double) * (size_t)nq * row)};
    double vmaxp = 0;
    double *kp = ref_keys(c, ps, layer);
    for (int64_t i = 0; i < nq; i++)
        for (int qz = 0; qz <= qdot; qz++)
            ref_one(c, ps, layer, kp, qp, (size_t)i * row, held - nq + i, scale, &o, qz,
                    refp[qz] + (size_t)i * row, &vmaxp);

    free(kp);
    const size_t stride = pkv_scratch_bytes(c->bs, d, c->item);
    void *scratch = xalloc(stride * max_threads);
    const int64_t partial_slots = 2 * max_threads;
    void *partial = xalloc(partial_slots * pkv_partial_slot_bytes(d, c->item));
    void *out = xalloc((size_t)(c->nseq > nq ? c->nseq : nq) * row * c->item);
    pkv_rope rope;
    int64_t plan[3];

    for (int simd = 0; simd < PKV_NUM_SIMD; simd++) {
        const pkv_kernels *kern = pkv_kernels_for(c->st, dt, simd);
        if (!pkv_simd_supported(simd) || !kern) continue;
        const int base = pkv_simd_base(simd);
        if (base != simd && kern->decode == pkv_kernels_for(c->st, dt, base)->decode) continue;
        const int qz = rounds_query(c->st, dt, simd, c->bs, c->rope_half);
        for (int nt = 1; nt <= max_threads; nt++) {
            pkv_attn_args a;
            fill_args(c, &a, layer, qd, out, scale, nt, scratch, stride, partial, partial_slots, &rope);
            a.window = o.window;
            a.softcap = o.softcap;
            a.sinks = o.sinks;
            a.nseq = c->nseq;
            a.nq = 1;
            a.plan_out = plan;
            memset(out, 0xFF, (size_t)c->nseq * row * c->item);
            kern->decode(&a);
            double w = compare(c, simd, out, 0, refd[qz], (size_t)c->nseq * row, vmaxd);
            CHECK(isfinite(w), "decode %s %s/%s threads=%d bs=%d d=%d hkv=%d hq=%d nseq=%d rope=%d split=%lld "
                  "window=%lld softcap=%g sinks=%d",
                  simd_names[simd], dtype_names[c->st], dtype_names[dt], nt, c->bs, d, c->hkv, c->hq, c->nseq,
                  c->rope_half, (long long)plan[2], (long long)o.window, o.softcap, o.sinks != NULL);
            if (w > t->worst[simd][pair]) t->worst[simd][pair] = w;
            if (nt == 1) {
                /* a NaN in query head 0 of sequence 0: that head's output is NaN on every
                 * path, softcap or not, every other output the same bits as without it */
                const size_t nout = (size_t)c->nseq * row * c->item;
                char *good = xalloc(nout);
                memcpy(good, out, nout);
                const double keep = get(qd, (size_t)d / 2, dt);
                put(qd, (size_t)d / 2, dt, NAN);
                memset(out, 0xFF, nout);
                kern->decode(&a);
                int nan_head = 1;
                for (int i = 0; i < d; i++) nan_head &= isnan(get(out, (size_t)i, dt));
                const size_t head = (size_t)d * c->item;
                const int rest_same = !memcmp((char *)out + head, good + head, nout - head);
                CHECK(nan_head && rest_same,
                      "decode %s %s/%s with a NaN query value: head 0 all NaN %d, other heads unchanged %d",
                      simd_names[simd], dtype_names[c->st], dtype_names[dt], nan_head, rest_same);
                put(qd, (size_t)d / 2, dt, keep);
                free(good);
            }
            t->threaded += plan[0] > 1;
            t->split += plan[2] > 1;

            /* prefill runs over segs[0]: point the batch at sequence ps */
            config one = *c;
            one.tables = c->tables + ps;
            one.segs = c->segs + ps;
            fill_args(&one, &a, layer, qp, out, scale, nt, scratch, stride, partial, partial_slots, &rope);
            a.window = o.window;
            a.softcap = o.softcap;
            a.sinks = o.sinks;
            a.nseq = 1;
            a.nq = nq;
            memset(out, 0xFF, (size_t)nq * row * c->item);
            kern->prefill(&a);
            w = compare(c, simd, out, 0, refp[qz], (size_t)nq * row, vmaxp);
            CHECK(isfinite(w), "prefill %s %s/%s threads=%d bs=%d d=%d hkv=%d hq=%d nq=%lld held=%lld rope=%d "
                  "window=%lld softcap=%g sinks=%d",
                  simd_names[simd], dtype_names[c->st], dtype_names[dt], nt, c->bs, d, c->hkv, c->hq, (long long)nq,
                  (long long)held, c->rope_half, (long long)o.window, o.softcap, o.sinks != NULL);
            if (w > t->worst[simd][pair]) t->worst[simd][pair] = w;
            t->cases[simd] += 2;
            t->pair_cases[simd][pair] += 2;
            if (dt == PKV_F32 && nt == 1) {
                check_qo16(c, kern, &a, simd, PKV_BF16);
                check_qo16(c, kern, &a, simd, PKV_F16);
                t->cases16[simd] += 2;
            }
        }
    }
    free(sinks);
    free(qd);
    free(refd[0]);
    free(refd[1]);
    free(qp);
    free(refp[0]);
    free(refp[1]);
    free(scratch);
    free(partial);
    free(out);
}

/* ---- the vector exp ------------------------------------------------------ */
typedef double (*exp_shift_fn)(void *, int, double);
#define EXP_WRAP(tag)                                                                       \
    static double exp_wrap##tag(void *s, int n, double mx) {                                \
        return exp2_shift##tag((PKV_CAT(ctype, tag) *)s, n, (PKV_CAT(ctype, tag))PKV_LOG2E, \
                               (PKV_CAT(ctype, tag))mx * (PKV_CAT(ctype, tag))PKV_LOG2E);   \
    }
typedef float ctype_f32_scalar;
typedef double ctype_f64_scalar;
EXP_WRAP(_f32_scalar)
EXP_WRAP(_f64_scalar)
#if PKV_X86
typedef float ctype_f32_avx2;
typedef double ctype_f64_avx2;
typedef float ctype_f32_avx512;
typedef double ctype_f64_avx512;
EXP_WRAP(_f32_avx2)
EXP_WRAP(_f64_avx2)
EXP_WRAP(_f32_avx512)
EXP_WRAP(_f64_avx512)
#endif
#if PKV_ARM64
typedef float ctype_f32_neon;
typedef double ctype_f64_neon;
EXP_WRAP(_f32_neon)
EXP_WRAP(_f64_neon)
#endif

static exp_shift_fn exp_fn(int simd, int dt) {
    switch (simd) {
    case PKV_SIMD_SCALAR: return dt ? exp_wrap_f64_scalar : exp_wrap_f32_scalar;
#if PKV_X86
    case PKV_SIMD_AVX2: return dt ? exp_wrap_f64_avx2 : exp_wrap_f32_avx2;
    case PKV_SIMD_AVX512: return dt ? exp_wrap_f64_avx512 : exp_wrap_f32_avx512;
#endif
#if PKV_ARM64
    case PKV_SIMD_NEON: return dt ? exp_wrap_f64_neon : exp_wrap_f32_neon;
#endif
    default: return NULL;
    }
}

/* exp over the softmax's range (x <= 0 after the max shift), vector lanes
 * and tail, against libm.  exp2_shift computes 2^(x log2(e)) with x log2(e)
 * rounded to the compute type, so besides a few ulp of the polynomial
 * (f32 4e-7, f64 1e-15 relative) each result carries that argument's
 * rounding (of log2(e) and of the product: up to an ulp of |x| log2(e)),
 * times ln 2, relative.  Arguments above 0 (at a row's max, rounding
 * makes them tiny) are held to the same bound.  Also the sum it returns over
 * x <= 0; below the clamp it stays finite */
static void check_exp(int simd, int dt) {
    enum { N = 1003 };
    const exp_shift_fn f = exp_fn(simd, dt);
    const int item = dt ? 8 : 4;
    const double lo = dt ? -700.0 : -86.0, hi = dt ? 700.0 : 87.0;
    void *x = xalloc(N * item);
    for (int i = 0; i < N; i++) put(x, i, dt, lo + (hi - lo) * i / (N - 1));
    void *y = xalloc(N * item);
    memcpy(y, x, N * item);
    f(y, N, 0.0);
    const double rtol = dt ? 1e-15 : 4e-7, eps = dt ? 0x1p-53 : 0x1p-24;
    double worst = 0;
    int nneg = 0; /* the first nneg points are <= 0, the softmax's domain */
    double want_sum = 0;
    for (int i = 0; i < N; i++) {
        const double xi = get(x, i, dt);
        const double want = exp(xi);
        const double tol = rtol + fabs(xi) * 2 * eps; /* |x| log2(e) 2 eps ln 2 */
        const double rel = fabs(get(y, i, dt) - want) / want / tol;
        if (!(rel <= worst)) worst = rel;
        if (xi > 0) continue;
        nneg = i + 1;
        want_sum += want;
    }
    CHECK(worst <= 1, "exp %s %s: worst relative error %.3g of its tolerance", simd_names[simd],
          dt ? "f64" : "f32", worst);
    memcpy(y, x, N * item);
    const double sum = f(y, nneg, 0.0);
    CHECK(fabs(sum - want_sum) <= 1e-6 * want_sum, "exp %s %s: sum %.17g, want %.17g",
          simd_names[simd], dt ? "f64" : "f32", sum, want_sum);
    /* far below the range: clamped, finite, tiny, not negative */
    for (int i = 0; i < 9; i++) put(y, i, dt, -1e30);
    f(y, 9, 0.0);
    for (int i = 0; i < 9; i++) {
        const double v = get(y, i, dt);
        CHECK(v >= 0 && v < 1e-37, "exp %s %s of -1e30 gave %g", simd_names[simd], dt ? "f64" : "f32", v);
    }
    free(x);
    free(y);
}

/* ---- row-batch linear (linear.h) ------------------------------------------ */

/* y = x W^T (+ b) over random shapes (rows 1..14 across the 3-row tile, K
 * odd and even across the vector width, N across the 4-row tile and the
 * thread split), 1 and 2 threads, with and without bias, against a double
 * reference: |y - ref| <= rtol * sum_k |x_k w_k| (+ |b|) with rtol of the
 * compute type.  y's rows are ldy > N apart; the columns past N hold NaN
 * before the call and must keep it. */
static long check_linear(int simd, int dt, int trials) {
    const int item = dt ? 8 : 4;
    const double rtol = rtol_of(dt == 1 ? PKV_F64 : PKV_F32);
    long cases = 0;
    for (int trial = 0; trial < trials; trial++) {
        /* the first trial does enough work (> PKV_PARALLEL_MIN) to run on 2 threads */
        const int64_t M = trial == 0 ? rnd_int(8, 14) : rnd_int(1, 14);
        const int64_t K = trial == 0 ? rnd_int(200, 300) : trial % 5 == 0 ? rnd_int(1, 9) : rnd_int(1, 300);
        const int64_t N = trial == 0 ? 2051 : rnd_int(1, 70), ldy = N + rnd_int(1, 5);
        const int bias = trial % 2, threads = 1 + trial % 3 % 2;
        void *x = xalloc((size_t)M * K * item), *w = xalloc((size_t)N * K * item);
        void *b = xalloc((size_t)N * item), *y = xalloc((size_t)M * ldy * item);
        for (int64_t i = 0; i < M * K; i++) put(x, i, dt, rnd_normal());
        for (int64_t i = 0; i < N * K; i++) put(w, i, dt, rnd_normal());
        for (int64_t i = 0; i < N; i++) put(b, i, dt, rnd_normal());
        for (int64_t i = 0; i < M * ldy; i++) put(y, i, dt, NAN);
        pkv_linear(dt, simd, trial == 0 ? 2 : threads, x, M, w, bias ? b : NULL, K, N, y, ldy);
        for (int64_t m = 0; m < M; m++) {
            for (int64_t n = 0; n < ldy; n++) {
                const double got = get(y, m * ldy + n, dt);
                if (n >= N) {
                    CHECK(isnan(got), "linear %s %s: y[%ld][%ld] past N=%ld written",
                          simd_names[simd], dt ? "f64" : "f32", (long)m, (long)n, (long)N);
                    continue;
                }
                double ref = bias ? get(b, n, dt) : 0.0, mag = fabs(ref);
                for (int64_t k = 0; k < K; k++) {
                    const double p = get(x, m * K + k, dt) * get(w, n * K + k, dt);
                    ref += p;
                    mag += fabs(p);
                }
                CHECK(fabs(got - ref) <= rtol * mag, "linear %s %s M=%ld K=%ld N=%ld: y[%ld][%ld] "
                      "= %.17g, want %.17g", simd_names[simd], dt ? "f64" : "f32", (long)M,
                      (long)K, (long)N, (long)m, (long)n, got, ref);
            }
        }
        cases++;
        free(x);
        free(w);
        free(b);
        free(y);
    }
    return cases;
}

/* The row conversions of convert.h (SSE2 / F16C where x86-64 has them, the
 * scalar rules elsewhere) against the scalar rules themselves: float32 ->
 * bfloat16 and float16 over a sample of every 2^32 bit pattern (each run of
 * 64 consecutive patterns at a random start, every 16,384 patterns: NaNs,
 * infinities, subnormals and ties included), float64 -> bfloat16 and float16
 * through the float32 rows rounded to odd, every bfloat16 and float16 value
 * into float32, and int8 groups against the rule
 * written out in double (convert.h's header) over random, tied, subnormal,
 * huge and poisoned groups.  Returns the values checked. */
static long check_convert(void) {
    long n = 0, bad16 = 0, badq = 0;
    float x[64];
    uint16_t a[64], b[64];
    for (uint64_t base = 0; base < (1ull << 32); base += 16384) {
        const uint32_t at = (uint32_t)(base + rnd_u64() % 16320);
        for (int i = 0; i < 64; i++) x[i] = pkv_bits_f32(at + (uint32_t)i);
        const int m = 57 + (int)(base >> 14) % 8; /* a tail past the last whole vector */
        pkv_f32_to_bf16_row(a, x, m);
        pkv_f32_to_f16_row(b, x, m);
        for (int i = 0; i < m; i++) {
            bad16 += a[i] != pkv_f32_to_bf16(x[i]);
            bad16 += b[i] != pkv_f32_to_f16(x[i]);
        }
        n += 2 * m;
    }
    CHECK(bad16 == 0, "float32 -> bfloat16 / float16 rows: %ld of %ld values differ from the scalar rules", bad16, n);
    /* float64 -> bfloat16 / float16 through the rows' float32 rounded to odd: any bits, exact
     * floats, values a hair off a float or on a tie between two, float32's range ends */
    long bad64 = 0, n64 = 0;
    for (int it = 0; it < 40000; it++) {
        double xd[64];
        float f[64];
        for (int i = 0; i < 64; i++) {
            const uint64_t r = rnd_u64();
            const float fr = pkv_bits_f32((uint32_t)r);
            double v;
            switch ((it + i) % 5) {
            case 0: memcpy(&v, &r, 8); break;
            case 1: v = (double)fr; break;
            case 2: v = (double)fr * (1.0 + ((r >> 40) & 1 ? 0x1p-30 : -0x1p-30)); break;
            case 3: v = (double)fr + ldexp((double)fr, -25); break;
            default: v = ldexp((double)(r >> 11), (int)(r % 400) - 253); break;
            }
            xd[i] = v;
        }
        const int m = 61 + it % 4;
        pkv_f64_to_f32_odd_row(f, xd, m);
        pkv_f32_to_bf16_row(a, f, m);
        pkv_f32_to_f16_row(b, f, m);
        for (int i = 0; i < m; i++) {
            bad64 += a[i] != pkv_f64_to_bf16(xd[i]);
            bad64 += b[i] != pkv_f64_to_f16(xd[i]);
        }
        n64 += 2 * m;
    }
    CHECK(bad64 == 0, "float64 -> bfloat16 / float16 rows: %ld of %ld values differ from the scalar rules", bad64, n64);
    n += n64;
    /* bfloat16 and float16 -> float32: every 16-bit input, bit for bit (NaNs keep their bits) */
    static uint16_t h16[1 << 16];
    static float f32[1 << 16];
    long bad32 = 0;
    for (int i = 0; i < 1 << 16; i++) h16[i] = (uint16_t)i;
    for (int type = PKV_BF16; type <= PKV_F16; type++) {
        pkv_16_to_f32_row(f32, h16, type, (1 << 16) - 5); /* a tail past the last whole vector */
        for (int i = 0; i < (1 << 16) - 5; i++) {
            const float want = type == PKV_BF16 ? pkv_bf16_to_f32(h16[i]) : pkv_f16_to_f32(h16[i]);
            bad32 += pkv_f32_bits(f32[i]) != pkv_f32_bits(want);
        }
        n += (1 << 16) - 5;
    }
    CHECK(bad32 == 0, "bfloat16 / float16 -> float32 rows: %ld values differ from the scalar rules", bad32);
    for (int it = 0; it < 200000; it++) {
        const int kind = it % 6, len = it % 7 == 0 ? 1 + it % 31 : 32;
        float xf[32];
        double xd[32], want_amax = 0;
        for (int i = 0; i < len; i++) {
            double v = (rnd_u64() >> 11) * 0x1p-53 * 2 - 1;
            if (kind == 1) v = (double)((int)(rnd_u64() % 511) - 255) / 2; /* ties after scaling */
            if (kind == 2) v *= 1e-40;                                   /* a subnormal scale */
            if (kind == 3) v *= exp((double)(rnd_u64() % 80) - 40);
            if (kind == 4 && i == len / 2) v = (it / 6) % 2 ? NAN : -INFINITY;
            if (kind == 5) v *= 1e300;                                   /* past float32 (f64 only) */
            xd[i] = v;
            xf[i] = (float)v;
        }
        for (int f64 = 0; f64 < 2; f64++) {
            if (kind == 5 && !f64) continue;
            int8_t q[32], want[32];
            const float sc = f64 ? pkv_quant_group_f64(q, xd, len) : pkv_quant_group_f32(q, xf, len);
            int poisoned = 0;
            want_amax = 0;
            for (int i = 0; i < len; i++) {
                const double v = f64 ? xd[i] : (double)xf[i];
                if (!(fabs(v) <= 1.7976931348623157e308)) poisoned = 1;
                else if (fabs(v) > want_amax) want_amax = fabs(v);
            }
            const float wsc = poisoned ? NAN : (float)(want_amax / 127.0);
            const double inv = wsc > 0 ? 1.0 / (double)wsc : 0.0;
            for (int i = 0; i < len; i++) {
                double r = poisoned ? 0 : rint((f64 ? xd[i] : (double)xf[i]) * inv);
                want[i] = (int8_t)(r > 127 ? 127 : r < -127 ? -127 : r);
            }
            badq += memcmp(q, want, (size_t)len) != 0 || !(sc == wsc || (isnan(sc) && isnan(wsc)));
            n += len;
        }
    }
    CHECK(badq == 0, "int8 groups: %ld differ from the quantization rule", badq);
    return n;
}

int main(int argc, char **argv) {
    int trials = 60;
    uint64_t seed = 20261123;
    const char *required[8];
    int nrequired = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--trials") && i + 1 < argc) trials = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--require") && i + 1 < argc && nrequired < 8) required[nrequired++] = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--trials N] [--seed S] [--require PATH]...\n", argv[0]);
            return 2;
        }
    }
    rng_s ^= seed * 0x9E3779B97F4A7C15ull;
    if (!rng_s) rng_s = 1;

    const int best = pkv_detect_simd();
    printf("architecture: %s; detected SIMD: %s; OpenMP: %s; trials: %d per compute dtype "
           "(a third of that per narrower storage); seed %llu\n",
           PKV_X86 ? "x86-64" : PKV_ARM64 ? "aarch64" : "other", simd_names[best],
           pkv_have_openmp() ? "yes" : "no", trials, (unsigned long long)seed);
    for (int simd = 0; simd < PKV_NUM_SIMD; simd++) {
        const int built = pkv_kernels_for(PKV_F32, PKV_F32, simd) != NULL;
        if (built && !pkv_simd_supported(simd))
            printf("  %-6s built, not supported by this CPU: skipped\n", simd_names[simd]);
    }

    printf("  storage conversions: %ld values checked against the scalar rules\n", check_convert());
    tally t;
    memset(&t, 0, sizeof t);
    for (int dt = 0; dt < 2; dt++)
        for (int simd = 0; simd < PKV_NUM_SIMD; simd++)
            if (pkv_simd_supported(simd) && exp_fn(simd, dt)) check_exp(simd, dt);
    for (int simd = 0; simd < PKV_NUM_SIMD; simd++) {
        if (!pkv_simd_supported(simd) || !pkv_kernels_for(PKV_F32, PKV_F32, simd)) continue;
        if (pkv_simd_base(simd) != simd) continue; /* the same linear kernel */
        const long n = check_linear(simd, 0, trials) + check_linear(simd, 1, trials);
        printf("  %-6s %5ld linear cases (f32, f64)\n", simd_names[simd], n);
    }
    for (int pair = 0; pair < NPAIRS; pair++) {
        const int st = pairs[pair][0], dt = pairs[pair][1];
        const int n = st == dt ? trials : (trials + 2) / 3;
        for (int i = 0; i < n; i++) {
            config c;
            config_make(&c, st, dt, i < 2); /* the first two: long, split over threads */
            check_layout(&c);
            check_attention(&c, &t, pair, i < 2);
            config_free(&c);
        }
    }

    int ran_any = 0;
    for (int simd = 0; simd < PKV_NUM_SIMD; simd++) {
        if (!t.cases[simd]) continue;
        ran_any = 1;
        printf("  %-6s %5ld attention cases; worst error / tolerance per storage/compute:",
               simd_names[simd], t.cases[simd]);
        for (int pair = 0, k = 0; pair < NPAIRS; pair++)
            if (t.pair_cases[simd][pair])
                printf("%s %s/%s %.3f", k++ % 3 ? "," : "\n        ", dtype_names[pairs[pair][0]],
                       dtype_names[pairs[pair][1]], t.worst[simd][pair]);
        if (pkv_simd_base(simd) != simd) printf(" (its other kernels are %s's)", simd_names[pkv_simd_base(simd)]);
        printf("\n         %ld calls with bf16/f16 queries and output: equal to the f32 result "
               "rounded\n", t.cases16[simd]);
    }
    for (int r = 0; r < nrequired; r++) {
        int found = 0;
        for (int simd = 0; simd < PKV_NUM_SIMD; simd++)
            if (!strcmp(required[r], simd_names[simd]) && t.cases[simd]) found = 1;
        CHECK(found, "required path %s did not run", required[r]);
    }
    CHECK(ran_any, "no path ran");
    printf("  decode calls on 2 threads: %ld, with keys split over threads: %ld\n", t.threaded, t.split);
    if (pkv_have_openmp() && trials >= 2)
        CHECK(t.threaded > 0 && t.split > 0, "the threaded and split-key decode paths did not run");
    if (failures) {
        printf("FAILED: %ld checks\n", failures);
        return 1;
    }
    printf("ALL OK\n");
    return 0;
}
