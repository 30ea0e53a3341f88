/* A whole Llama/Qwen2 decoder layer on the k-quant kernel, in one call and one parallel region.
 *
 * Torch runs a layer as some forty small operations; at one row each costs more in dispatch than
 * in arithmetic, a third of a 0.5B draft's token. Here the same layer is one C call: RMS norm,
 * the fused q/k/v projection, RoPE, the cache write, attention, the output projection, the gated
 * MLP and both residual adds; and a model's layers one after another are one call and one parallel
 * region too (sp_layers).
 *
 * Row-invariant by construction, like the kernel it calls: every row's norm, RoPE and attention
 * read that row (and the cache) alone, each sum runs in one fixed order (eight float lanes, then
 * those lanes in one order; attention over the visible slots in ascending order), and the threads
 * share rows or (row, head) pairs, never one sum. A row's result is therefore the same whether it
 * is computed alone or inside a block of any size, at any thread count.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kquant.h"

#define VEC "avx2,fma"

/* Sum of x[i] * y[i] over n (a multiple of 8) in eight lanes, the lanes added in one fixed order. */
__attribute__((target(VEC))) static float dot8(const float *x, const float *y, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), acc);
    float l[8];
    _mm256_storeu_ps(l, acc);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* out = weight * (x / sqrt(mean(x^2) + eps)), a row of n values. */
__attribute__((target(VEC))) static void rms_norm_row(const float *x, const float *w, int64_t n, float eps, float *out) {
    float r = 1.0f / sqrtf(dot8(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* e^x in each of eight lanes, one fixed sequence of operations per lane (so a value's result never
 * depends on its neighbours, the vector width or the path): x clamped to [-87, 88] (a NaN kept),
 * x = n ln 2 + r with n the nearest integer to x / ln 2 and ln 2 in two parts (Cody and Waite), e^r
 * by Cephes' polynomial (within 1 ulp of e^x over the clamp: every eighth float of it checked against
 * double precision), times 2^n from its exponent bits. Outside the clamp the result saturates (e^88
 * for more, e^-87 for less) instead of overflowing. Eight lanes at once where libm's expf took one
 * value at a time: the MLP's gate read 8,960 a row. */
__attribute__((target(VEC))) static __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* The gated MLP's activation of eight values: silu(g) * u = g / (1 + e^-g) * u. */
__attribute__((target(VEC))) static __m256 silu_gate8(__m256 g, __m256 u) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

/* Values [j, j + 8) of a row's activation (gate ``g``, up ``u``) into ``act``; past ``n``, none: the
 * tail goes through the same eight lanes, padded. */
__attribute__((target(VEC))) static void silu_gate_at(const float *g, const float *u, int64_t n, int64_t j, float *act) {
    if (j + 8 <= n) {
        _mm256_storeu_ps(act + j, silu_gate8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
        return;
    }
    float gp[8] = {0}, up[8] = {0}, out[8];
    memcpy(gp, g + j, (size_t)(n - j) * sizeof(float));
    memcpy(up, u + j, (size_t)(n - j) * sizeof(float));
    _mm256_storeu_ps(out, silu_gate8(_mm256_loadu_ps(gp), _mm256_loadu_ps(up)));
    memcpy(act + j, out, (size_t)(n - j) * sizeof(float));
}

/* Scores [t, t + 8) of ``n`` (a tail padded) as softmax weights before their total: e^(score - top),
 * an unseen slot's -INFINITY kept. */
__attribute__((target(VEC))) static void exp_seen_at(float *sc, int64_t n, int64_t t, float top) {
    float pad[8];
    float *v = sc + t;
    if (t + 8 > n) {
        for (int i = 0; i < 8; i++) pad[i] = t + i < n ? sc[t + i] : -INFINITY;
        v = pad;
    }
    __m256 x = _mm256_loadu_ps(v), unseen = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    _mm256_storeu_ps(v, _mm256_blendv_ps(exp8(_mm256_sub_ps(x, _mm256_set1_ps(top))), x, unseen));
    if (v == pad) memcpy(sc + t, pad, (size_t)(n - t) * sizeof(float));
}

/* The rotate-half RoPE of one head of d values, in place. */
static void rope(float *x, const float *c, const float *s, int64_t d) {
    int64_t half = d / 2;
    float t[256];
    for (int64_t j = 0; j < half; j++) t[j] = x[j] * c[j] - x[j + half] * s[j];
    for (int64_t j = half; j < d; j++) t[j] = x[j] * c[j] + x[j - half] * s[j];
    memcpy(x, t, (size_t)d * sizeof(float));
}

static int64_t most_blocks(const sp_layer_t *L) {
    int64_t k = L->qkv.k;
    if (L->o.k > k) k = L->o.k;
    if (L->gate_up.k > k) k = L->gate_up.k;
    if (L->down.k > k) k = L->down.k;
    return k / 256;
}

/* Whether a projection is not ``width`` inputs (``k``: rounded up to whole blocks of 256) to ``out``
 * outputs in 1 to 3 k-quant matrices whose rows add up to ``out`` (sp_bad_linear). */
static int bad_projection(const sp_linear_t *l, int64_t width, int64_t out) {
    return sp_bad_linear(l) || l->width != width || l->out != out || l->k - width >= QK;
}

/* Whether a layer's sizes disagree with each other, or are ones the layer does not run (heads of
 * more than 256 values, head_dim or hidden not a multiple of 8): checked before anything is read. */
static int bad_layer(const sp_layer_t *L) {
    int64_t H = L->hidden, heads = L->heads, kv = L->kv_heads, d = L->head_dim, I = L->inter;
    if (H < 8 || H % 8 || H > MOST_SIZE || d < 8 || d % 8 || d > 256 || heads < 1 || heads > MOST_SIZE ||
        kv < 1 || heads % kv || I < 1 || I > MOST_SIZE || !L->ln_in || !L->ln_post)
        return 1;
    return bad_projection(&L->qkv, H, (heads + 2 * kv) * d) || bad_projection(&L->o, heads * d, H) ||
           bad_projection(&L->gate_up, H, 2 * I) || bad_projection(&L->down, I, H);
}

/* Bytes of scratch one layer's ``m`` rows need, or -1 (bad arguments) for a layer :func:`sp_layers` refuses. */
static int64_t layer_scratch(const sp_layer_t *L, int64_t m) {
    if (!L || bad_layer(L) || m < 0 || m > MOST_SIZE) return SP_BAD_ARGUMENTS;
    int64_t floats = m * (2 * L->hidden + L->qkv.out + L->heads * L->head_dim + 3 * L->inter);
    return floats * (int64_t)sizeof(float) + 64 + m * most_blocks(L) * sp_sizeof_blockx();
}

/* Four consecutive slots' dot8 with q, each the same sum as dot8's alone: four chains in flight
 * instead of one. */
__attribute__((target(VEC))) static void dot8x4(const float *q, const float *k0, int64_t d, float *out) {
    const float *k1 = k0 + d, *k2 = k1 + d, *k3 = k2 + d;
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < d; i += 8) {
        __m256 v = _mm256_loadu_ps(q + i);
        a[0] = _mm256_fmadd_ps(v, _mm256_loadu_ps(k0 + i), a[0]);
        a[1] = _mm256_fmadd_ps(v, _mm256_loadu_ps(k1 + i), a[1]);
        a[2] = _mm256_fmadd_ps(v, _mm256_loadu_ps(k2 + i), a[2]);
        a[3] = _mm256_fmadd_ps(v, _mm256_loadu_ps(k3 + i), a[3]);
    }
    for (int s = 0; s < 4; s++) {
        float l[8];
        _mm256_storeu_ps(l, a[s]);
        out[s] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    }
}

/* Lanes [j, j + 64) of the weighted sum of the values V over the slots whose weight ``p`` is not
 * -INFINITY (unseen), in ascending slot order, each lane's running sum kept in a register. */
__attribute__((target(VEC))) static void weigh64(const float *p, const float *V, int64_t d, int64_t slots, int64_t j,
                                                 float *out) {
    __m256 a[8];
    for (int c = 0; c < 8; c++) a[c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < slots; t++) {
        if (p[t] == -INFINITY) continue;
        __m256 w = _mm256_set1_ps(p[t]);
        const float *v = V + t * d + j;
        for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), a[c]);
    }
    for (int c = 0; c < 8; c++) _mm256_storeu_ps(out + j + 8 * c, a[c]);
}

/* Attention of row i, head h over the visible slots, ascending; ``sc`` holds a score a slot, then
 * its weight. Whatever the grouping of the work, each score is dot8's, the weights and their total
 * one scalar sequence in slot order, and each output lane one chain of fused multiply-adds in slot
 * order. */
__attribute__((target(VEC))) static void attend(const sp_layer_t *L, const float *q, const float *kv, int64_t cap,
                                                int64_t i, int64_t h, int64_t slots, const uint8_t *mask,
                                                int causal, int64_t base, float *sc, float *out) {
    int64_t d = L->head_dim, g = h / (L->heads / L->kv_heads), t = 0, j = 0;
    const float *K = kv + g * cap * d, *V = kv + (L->kv_heads + g) * cap * d;
    float scale = 1.0f / sqrtf((float)d), top = -INFINITY, total = 0.0f, acc[256];
    for (; t + 4 <= slots; t += 4) dot8x4(q, K + t * d, d, sc + t);
    for (; t < slots; t++) sc[t] = dot8(q, K + t * d, d);
    for (t = 0; t < slots; t++) {
        int seen = mask ? mask[i * slots + t] != 0 : causal ? t <= base + i : 1;
        sc[t] = seen ? sc[t] * scale : -INFINITY;
        top = sc[t] > top ? sc[t] : top; /* fmaxf inlined: a NaN score leaves top, as fmaxf does */
    }
    for (t = 0; t < slots; t += 8) exp_seen_at(sc, slots, t, top);
    for (t = 0; t < slots; t++)
        if (sc[t] != -INFINITY) total += sc[t];
    for (; j + 64 <= d; j += 64) weigh64(sc, V, d, slots, j, acc);
    for (; j < d; j += 8) { /* a head of a size not a multiple of 64: eight lanes at a time */
        __m256 a = _mm256_setzero_ps();
        for (t = 0; t < slots; t++)
            if (sc[t] != -INFINITY) a = _mm256_fmadd_ps(_mm256_set1_ps(sc[t]), _mm256_loadu_ps(V + t * d + j), a);
        _mm256_storeu_ps(acc + j, a);
    }
    for (j = 0; j < d; j++) out[j] = acc[j] / total;
}

/* Layer ``L``'s work inside the parallel region over the rows ``x`` (see sp_layers), its scratch at
 * ``scratch``. ``sc``: this thread's score a slot, or NULL where it could not be had (the caller then
 * fails the call). */
static void layer_rows(int isa, const sp_layer_t *L, float *x, int64_t m, const float *cos, const float *sin,
                       float *kv, int64_t cap, int64_t base, const uint8_t *mask, int causal, void *scratch,
                       float *sc) {
    int64_t H = L->hidden, d = L->head_dim, nq = L->heads * d, nkv = L->kv_heads * d, I = L->inter;
    float *h = (float *)scratch, *qkv = h + m * H, *att = qkv + m * L->qkv.out, *gu = att + m * nq,
          *act = gu + m * 2 * I, *y = act + m * I;
    blockx *xq = (blockx *)(((uintptr_t)(y + m * H) + 63) & ~(uintptr_t)63);
    int64_t slots = base + m;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) rms_norm_row(x + r * H, L->ln_in, H, L->eps, h + r * H);
    sp_project(isa, &L->qkv, h, m, H, xq, qkv, L->qkv.out);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        float *row = qkv + r * L->qkv.out;
        for (int64_t hq = 0; hq < L->heads; hq++) rope(row + hq * d, cos + r * d, sin + r * d, d);
        for (int64_t g = 0; g < L->kv_heads; g++) {
            float *k = row + nq + g * d;
            rope(k, cos + r * d, sin + r * d, d);
            memcpy(kv + (g * cap + base + r) * d, k, (size_t)d * sizeof(float));
            memcpy(kv + ((L->kv_heads + g) * cap + base + r) * d, row + nq + nkv + g * d, (size_t)d * sizeof(float));
        }
    }
#pragma omp for schedule(static)
    for (int64_t p = 0; p < m * L->heads; p++) {
        int64_t r = p / L->heads, hq = p % L->heads;
        if (sc) attend(L, qkv + r * L->qkv.out + hq * d, kv, cap, r, hq, slots, mask, causal, base, sc, att + r * nq + hq * d);
    }
    sp_project(isa, &L->o, att, m, nq, xq, y, H);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        for (int64_t j = 0; j < H; j++) x[r * H + j] += y[r * H + j];
        rms_norm_row(x + r * H, L->ln_post, H, L->eps, h + r * H);
    }
    sp_project(isa, &L->gate_up, h, m, H, xq, gu, 2 * I);
    /* Each value its own: a lone row's are shared among the threads too, eight at a time. */
#pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < I; j += 8) silu_gate_at(gu + r * 2 * I, gu + r * 2 * I + I, I, j, act + r * I);
    sp_project(isa, &L->down, act, m, I, xq, y, H);
#pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < H; j++) x[r * H + j] += y[r * H + j];
}

/* Bytes of scratch a call of ``m`` rows through the ``n`` layers ``Ls`` needs, or -1 (bad arguments)
 * where sp_layers refuses one of them. */
int64_t sp_layers_scratch(const sp_layer_t *Ls, int64_t n, int64_t m) {
    if (!Ls || n < 1 || n > MOST_SIZE) return SP_BAD_ARGUMENTS;
    int64_t most = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t bytes = layer_scratch(Ls + i, m);
        if (bytes < 0) return bytes;
        most = bytes > most ? bytes : most;
    }
    return most;
}

/* The ``n`` decoder layers ``Ls`` one after another over ``m`` new rows ``x`` (``m`` x hidden, updated
 * in place) at cache slots ``base`` .. ``base + m - 1`` of each layer's cache ``kvs[i]`` ([2, kv_heads,
 * cap, head_dim] float32), in one parallel region. ``cos``/``sin``: the rows' RoPE tables (m x
 * head_dim). A row sees the slots ``mask`` allows (m x (base + m) bytes), or without one: slots up to
 * its own (``causal``) or all of them. ``scratch``: :func:`sp_layers_scratch` bytes. Returns a status:
 * bad arguments for a layer whose sizes disagree (:func:`bad_layer`, every layer checked before any
 * runs) or rows past the cache, out of memory where a thread's attention scores could not be had
 * (``x`` and the caches are then to be thrown away). */
int sp_layers(int isa, const sp_layer_t *Ls, int64_t n, float *x, int64_t m, const float *cos, const float *sin,
              float *const *kvs, int64_t cap, int64_t base, const uint8_t *mask, int causal, void *scratch) {
    if ((isa != 2 && isa != 3) || sp_layers_scratch(Ls, n, m) < 0 || base < 0 || cap < 0 || base > cap - m ||
        (m && (!x || !cos || !sin || !kvs || !scratch)))
        return SP_BAD_ARGUMENTS;
    for (int64_t i = 0; m && i < n; i++)
        if (!kvs[i]) return SP_BAD_ARGUMENTS;
    int failed = 0;
#pragma omp parallel
    {
        float *sc = malloc((size_t)(base + m) * sizeof(float));
        if (!sc) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t i = 0; i < n; i++)
            layer_rows(isa, Ls + i, x, m, cos, sin, kvs[i], cap, base, mask, causal, scratch, sc);
        free(sc);
    }
    return failed ? SP_OUT_OF_MEMORY : SP_OK;
}
