/* fp16kit's fused master Adam/AdamW step for the CPU, in one pass over each tensor.
 *
 * Built at first use by fp16kit/core/fused/build.py (gcc or cc, -O2, OpenMP) and called through
 * ctypes. Per tensor i of a plan (all arrays of length n):
 *
 *     step += 1; bc1 = 1 - beta1 ** step; bc2 = 1 - beta2 ** step   (in double, as torch)
 *     g  = float(grad16[i]) / scale            (no grad_scale pointer: no division; or the fp32 grad)
 *     p  = master[i]
 *     AdamW, wd != 0:  p = p * decay           (decay = float(1 - lr * wd))
 *     Adam,  wd != 0:  g = g + p * wd
 *     m  = lerp(m, g, w)                       (w = float(1 - beta1); torch's two-sided form)
 *     v  = v * beta2 + (c2 * g) * g            (c2 = float(1 - beta2))
 *     p  = p + (nss * m) / (sqrt(v) / bc2s + eps)
 *     master[i] = p;  param16[i] = round_to_nearest_even(p)
 *
 * which is, operation for operation and in the same order, what torch's fused CPU Adam kernel
 * (torch.optim.AdamW(fused=True), float32 params) does with grad_scale set, followed by the copy
 * of the masters into the 16-bit params. torch splits each tensor into vectors of `vl` floats (the
 * width of its CPU capability: 16 for AVX512, 8 for AVX2) and a scalar tail of numel % vl
 * elements; the two parts differ in how lerp is rounded (an explicit fused multiply-add in the
 * body) and in which a * b + c torch's compiler contracted into one (and whether it vectorized the
 * first 8 of a tail of 8 or more), so the kernel takes those forms from the caller (`body`, `tail`,
 * `tail8`), which fp16kit/core/fused/adam.py establishes against torch itself at first use.
 *
 * Nothing is written when *found_inf == 1 (the whole step is skipped, as torch's fused step
 * skips on its found_inf). With `land`, param16[i] = round_to_nearest_even(master[i]) is written
 * from the master as it was *before* the step (on a skipped step too): an inline asynchronous
 * job, which lands the previous step's masters in the model and steps them in the same pass.
 * fp16kit_check_finite sets *found_inf = 1 when a grad holds inf/NaN. fp16kit_unscale_to is the
 * master-grad path in one pass: fp32 master grad = float(grad16) * inv_scale, the flag set as
 * torch's _amp_foreach_non_finite_check_and_unscale_ sets it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define AVX __attribute__((target("avx2,fma,f16c")))

enum { HALF = 0, BF16 = 1, F32 = 2 }; /* F32: grads only (the fp32 master grads of apex's faces) */

int fp16kit_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* ------------------------------------------------------------------ 16-bit <-> float */
AVX static inline float load1(const uint16_t *x, int64_t k, int kind) {
    if (kind == BF16) {
        uint32_t u = (uint32_t)x[k] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return _cvtsh_ss(x[k]);
}

AVX static inline uint16_t round1(float f, int kind) {
    if (kind == BF16) {
        uint32_t u;
        memcpy(&u, &f, 4);
        if (f != f) return 0x7fc0;  /* c10::BFloat16's NaN */
        return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}

AVX static inline __m256 load8(const uint16_t *x, int64_t k, int kind) {
    __m128i h = _mm_loadu_si128((const __m128i *)(x + k));
    if (kind == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

AVX static inline void store8(uint16_t *x, int64_t k, __m256 f, int kind) {
    __m128i h;
    if (kind == BF16) {
        __m256i u = _mm256_castps_si256(f);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
        __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
        /* pack 8 x u32 (each < 65536) into 8 x u16 */
        __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
        h = _mm_packus_epi32(lo, hi);
    } else {
        h = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT);
    }
    _mm_storeu_si128((__m128i *)(x + k), h);
}

/* ------------------------------------------------------------------ the step */
typedef struct {           /* a param group's hyperparameters, as torch's fused kernel takes them */
    double lr, beta1, beta2, eps, weight_decay;
    int32_t mode;          /* 0: Adam (L2 weight decay), 1: AdamW (decoupled), 2: no weight decay */
    int32_t body;          /* how torch's compiler contracted a * b + c in its vector body: */
    int32_t tail;          /* and in its scalar tail: 0 not, 1 into the later product, 2 the earlier */
    int32_t vl;            /* torch's vector width in floats (the tail is numel % vl) */
    int32_t tail8;         /* a tail of 8 or more: its first 8 as one 8-wide vector, contracted as
                              `body` says (1), or not vectorized (0) -- what the compiler did */
} Group;

typedef struct {           /* one tensor's coefficients, in float, from its step (torch's rounding) */
    float inv_scale_div;   /* the scale to divide by; 0: none */
    float decay;           /* AdamW: float(1 - lr * wd) */
    float wd;              /* Adam: float(wd) */
    float w;               /* float(1 - beta1) */
    float beta2;           /* float(beta2) */
    float c2;              /* float(1 - beta2) */
    float bc2s;            /* float(sqrt(1 - beta2 ** step)) */
    float eps;             /* float(eps) */
    float nss;             /* float(-(lr / (1 - beta1 ** step))) */
    int32_t mode, body, tail, vl, tail8;
} Hyper;

static void hyper_of(const Group *g, float step, const float *grad_scale, Hyper *h) {
    double st = (double)step; /* torch: state_step.item<float>(), then double math */
    double bc1 = 1 - pow(g->beta1, st), bc2 = 1 - pow(g->beta2, st);
    h->inv_scale_div = grad_scale ? *grad_scale : 0.0f;
    h->decay = (float)(1 - g->lr * g->weight_decay);
    h->wd = (float)g->weight_decay;
    h->w = (float)(1 - g->beta1);
    h->beta2 = (float)g->beta2;
    h->c2 = (float)(1 - g->beta2);
    h->bc2s = (float)sqrt(bc2);
    h->eps = (float)g->eps;
    h->nss = (float)(-(g->lr / bc1));
    h->mode = g->weight_decay != 0 ? g->mode : 2;
    h->body = g->body;
    h->tail = g->tail;
    h->vl = g->vl;
    h->tail8 = g->tail8;
}

AVX static inline float scalar_step(float g, float *mp, float *ap, float *vp, const Hyper *h) {
    /* torch's tail, with its compiler's contraction of a * b + c (h->tail) */
    const int fused = h->tail != 0;
    float p = *mp, m = *ap, v = *vp;
    if (h->inv_scale_div != 0.0f) g = g / h->inv_scale_div;
    if (h->mode == 1) p = p * h->decay;
    else if (h->mode == 0) g = fused ? fmaf(p, h->wd, g) : g + p * h->wd;
    if (fabsf(h->w) < 0.5f) m = fused ? fmaf(h->w, g - m, m) : m + h->w * (g - m);
    else m = fused ? fmaf(-(g - m), 1.0f - h->w, g) : g - (g - m) * (1.0f - h->w);
    float t = h->c2 * g;
    v = h->tail == 1 ? fmaf(t, g, v * h->beta2) : h->tail == 2 ? fmaf(v, h->beta2, t * g) : v * h->beta2 + t * g;
    float denom = sqrtf(v) / h->bc2s + h->eps;
    p = p + (h->nss * m) / denom;
    *mp = p;
    *ap = m;
    *vp = v;
    return p;
}

/* One tensor, elements [lo, hi) (lo a multiple of 8); the grads are of `gkind` (a 16-bit kind or F32).
 * p16 gets the master after the step, or with `land` the master before it. */
AVX static void step_range(const void *gp, uint16_t *p16, float *mp, float *ap, float *vp, int64_t numel,
                           int64_t lo, int64_t hi, const Hyper *h, int kind, int gkind, int land) {
    const uint16_t *g16 = (const uint16_t *)gp;
    const float *g32 = (const float *)gp;
    int64_t body = numel - numel % h->vl; /* torch's vector part of this tensor */
    int64_t vend = hi < body ? hi : body;
    const __m256 vscale = _mm256_set1_ps(h->inv_scale_div), vdecay = _mm256_set1_ps(h->decay);
    const __m256 vwd = _mm256_set1_ps(h->wd), vw = _mm256_set1_ps(h->w), vb2 = _mm256_set1_ps(h->beta2);
    const __m256 vc2 = _mm256_set1_ps(h->c2), vbc2s = _mm256_set1_ps(h->bc2s), veps = _mm256_set1_ps(h->eps);
    const __m256 vnss = _mm256_set1_ps(h->nss);
    const int small = fabsf(h->w) < 0.5f;
    const __m256 coeff = small ? vw : _mm256_sub_ps(vw, _mm256_set1_ps(1.0f));
    int64_t k = lo;
    if (h->tail8 && hi == numel && numel - body >= 8) vend = body + 8;
    for (; k + 8 <= vend; k += 8) {
        __m256 g = gkind == F32 ? _mm256_loadu_ps(g32 + k) : load8(g16, k, gkind);
        if (h->inv_scale_div != 0.0f) g = _mm256_div_ps(g, vscale);
        __m256 p = _mm256_loadu_ps(mp + k);
        if (land && p16) store8(p16, k, p, kind);
        if (h->mode == 1) p = _mm256_mul_ps(p, vdecay);
        else if (h->mode == 0) g = h->body ? _mm256_fmadd_ps(p, vwd, g) : _mm256_add_ps(g, _mm256_mul_ps(p, vwd));
        __m256 m = _mm256_loadu_ps(ap + k);
        __m256 diff = _mm256_sub_ps(g, m);
        m = _mm256_fmadd_ps(coeff, diff, small ? m : g);
        __m256 t = _mm256_mul_ps(vc2, g);
        __m256 v = _mm256_loadu_ps(vp + k);
        v = h->body == 1   ? _mm256_fmadd_ps(t, g, _mm256_mul_ps(v, vb2))
            : h->body == 2 ? _mm256_fmadd_ps(v, vb2, _mm256_mul_ps(t, g))
                           : _mm256_add_ps(_mm256_mul_ps(v, vb2), _mm256_mul_ps(t, g));
        __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), vbc2s), veps);
        p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(vnss, m), denom));
        _mm256_storeu_ps(ap + k, m);
        _mm256_storeu_ps(vp + k, v);
        _mm256_storeu_ps(mp + k, p);
        if (p16 && !land) store8(p16, k, p, kind);
    }
    for (; k < hi; k++) { /* [vend, hi) is torch's tail: chunks are multiples of 16 elements */
        if (land && p16) p16[k] = round1(mp[k], kind);
        float p = scalar_step(gkind == F32 ? g32[k] : load1(g16, k, gkind), mp + k, ap + k, vp + k, h);
        if (p16 && !land) p16[k] = round1(p, kind);
    }
}

/* p16 = round_to_nearest_even(master), elements [lo, hi): the landing of a skipped step (`land`). */
AVX static void land_range(uint16_t *p16, const float *mp, int64_t lo, int64_t hi, int kind) {
    int64_t k = lo;
    for (; k + 8 <= hi; k += 8) store8(p16, k, _mm256_loadu_ps(mp + k), kind);
    for (; k < hi; k++) p16[k] = round1(mp[k], kind);
}

/* Tensor `i` of the plan holding chunk `c` (chunk_start[i] <= c < chunk_start[i + 1]). */
static int64_t tensor_of(const int64_t *chunk_start, int64_t n, int64_t c) {
    int64_t lo = 0, hi = n;
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (chunk_start[mid] <= c) lo = mid;
        else hi = mid;
    }
    return lo;
}

/* The step over n tensors. ptrs[6 * i ...]: grad (16-bit of `kind`, or float32 when gkind == F32),
 * 16-bit param (0: not written -- an asynchronous step's job, whose params the next landing writes,
 * or an fp32 param stepped in place as its own "master"), master, exp_avg, exp_avg_sq,
 * step (float32, 0-dim); numel[i]; chunk_start[i]: the index of tensor i's first chunk of `chunk`
 * elements (a multiple of 16), chunk_start[n] == the number of chunks, the parallel work items.
 * `land`: the 16-bit params get the masters as they were before the step (see the top). */
AVX int32_t fp16kit_master_adam(int64_t n, const int64_t *ptrs, const int64_t *numel, const int64_t *chunk_start,
                             int64_t chunk, const Group *group, int32_t kind, int32_t gkind, int32_t land,
                             const float *grad_scale, const float *found_inf, int32_t threads) {
    if (found_inf && *found_inf == 1.0f) { /* torch's fused skip: nothing changes, steps included */
        if (!land) return 0;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
        for (int64_t c = 0; c < chunk_start[n]; c++) {
            int64_t i = tensor_of(chunk_start, n, c), lo = (c - chunk_start[i]) * chunk;
            int64_t hi = lo + chunk < numel[i] ? lo + chunk : numel[i];
            if (ptrs[6 * i + 1]) land_range((uint16_t *)ptrs[6 * i + 1], (const float *)ptrs[6 * i + 2], lo, hi, kind);
        }
        return 0;
    }
    for (int64_t i = 0; i < n; i++) *(float *)ptrs[6 * i + 5] += 1.0f; /* torch: _foreach_add_(steps, 1) */
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
    for (int64_t c = 0; c < chunk_start[n]; c++) {
        int64_t i = tensor_of(chunk_start, n, c), lo = (c - chunk_start[i]) * chunk;
        int64_t hi = lo + chunk < numel[i] ? lo + chunk : numel[i];
        const int64_t *t = ptrs + 6 * i;
        Hyper h;
        hyper_of(group, *(const float *)t[5], grad_scale, &h);
        step_range((const uint16_t *)t[0], (uint16_t *)t[1], (float *)t[2], (float *)t[3], (float *)t[4], numel[i], lo,
                   hi, &h, kind, gkind, land);
    }
    return 1; /* stepped */
}

/* *found_inf = 1 when any of the n 16-bit grads (addresses in grads, sizes in numel; chunks as above)
 * holds inf or NaN; it is only ever set. */
AVX void fp16kit_check_finite(int64_t n, const int64_t *grads, const int64_t *numel, const int64_t *chunk_start,
                              int64_t chunk, int32_t kind, float *found_inf, int32_t threads) {
    int bad = 0;
    const uint16_t expo = kind == BF16 ? 0x7f80 : 0x7c00; /* exponent all ones: inf or NaN */
    const __m256i vexpo = _mm256_set1_epi16((short)expo);
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads) reduction(| : bad)
    for (int64_t c = 0; c < chunk_start[n]; c++) {
        int64_t i = tensor_of(chunk_start, n, c), lo = (c - chunk_start[i]) * chunk;
        int64_t hi = lo + chunk < numel[i] ? lo + chunk : numel[i];
        const uint16_t *x = (const uint16_t *)grads[i];
        /* 16 grads per compare: a scalar loop here cost a third of the whole step */
        __m256i acc = _mm256_setzero_si256();
        int64_t k = lo;
        for (; k + 16 <= hi; k += 16) {
            __m256i h = _mm256_loadu_si256((const __m256i *)(x + k));
            acc = _mm256_or_si256(acc, _mm256_cmpeq_epi16(_mm256_and_si256(h, vexpo), vexpo));
        }
        int tail = 0;
        for (; k < hi; k++) tail |= (x[k] & expo) == expo;
        bad |= tail | !_mm256_testz_si256(acc, acc);
    }
    if (bad) *found_inf = 1.0f;
}

/* The master-grad path: dst[k] = float(src[k]) * inv_scale for n pairs (16-bit source at pairs[2 * i],
 * float32 destination at pairs[2 * i + 1]; sizes and chunks as above) -- torch's copy into float32
 * then its check-and-unscale, which multiplies unless inv_scale == 1 -- and *found_inf = 1 when a
 * source holds inf or NaN (only ever set). 2 bytes read and 4 written per element, one pass. */
AVX void fp16kit_unscale_to(int64_t n, const int64_t *pairs, const int64_t *numel, const int64_t *chunk_start,
                            int64_t chunk, int32_t kind, const float *inv_scale, float *found_inf, int32_t threads) {
    const float inv = *inv_scale;
    const int mul = inv != 1.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    const uint16_t expo = kind == BF16 ? 0x7f80 : 0x7c00; /* exponent all ones: inf or NaN */
    const __m128i vexpo = _mm_set1_epi16((short)expo);
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads) reduction(| : bad)
    for (int64_t c = 0; c < chunk_start[n]; c++) {
        int64_t i = tensor_of(chunk_start, n, c), lo = (c - chunk_start[i]) * chunk;
        int64_t hi = lo + chunk < numel[i] ? lo + chunk : numel[i];
        const uint16_t *x = (const uint16_t *)pairs[2 * i];
        float *y = (float *)pairs[2 * i + 1];
        __m128i acc = _mm_setzero_si128();
        int64_t k = lo;
        for (; k + 8 <= hi; k += 8) {
            __m128i h = _mm_loadu_si128((const __m128i *)(x + k));
            acc = _mm_or_si128(acc, _mm_cmpeq_epi16(_mm_and_si128(h, vexpo), vexpo));
            __m256 f = kind == BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                    : _mm256_cvtph_ps(h);
            if (mul) f = _mm256_mul_ps(f, vinv);
            _mm256_storeu_ps(y + k, f);
        }
        int tail = 0;
        for (; k < hi; k++) {
            float f = load1(x, k, kind);
            y[k] = mul ? f * inv : f;
            tail |= (x[k] & expo) == expo;
        }
        bad |= tail | !_mm_testz_si128(acc, acc);
    }
    if (bad) *found_inf = 1.0f;
}
