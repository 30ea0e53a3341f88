/* The k-quant kernel's blocks (kquant.h): GGUF's Q4_K and Q6_K blocks repacked for the kernel, a
 * draft's other matrices fitted into Q4_K blocks, rows of blocks dequantized (an embedding lookup),
 * and activations quantized per row into blocks of 256. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kquant.h"

int sp_sizeof_blockx(void) { return (int)sizeof(blockx); }
int sp_sizeof_block(int type) { return type == TYPE_Q4_K ? (int)sizeof(block4) : type == TYPE_Q6_K ? (int)sizeof(block6) : -1; }
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 1024)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 1023) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* GGUF's packing of Q4_K's eight 6-bit scales and mins into 12 bytes. */
static void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Four-bit values in position order -> the packed memory order of block4.qs. */
static void pack_nibbles(const uint8_t *v, uint8_t *qs) {
    for (int b = 0; b < 128; b++) qs[b] = (uint8_t)(v[position(b)] | (v[position(b + 128)] << 4));
}

/* A GGUF Q4_K block's 256 four-bit values in position order. */
static void q4k_values(const uint8_t *qs, uint8_t *v) {
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            v[64 * j + l] = qs[32 * j + l] & 0xF;
            v[64 * j + 32 + l] = qs[32 * j + l] >> 4;
        }
}

/* A GGUF Q6_K block's 256 six-bit values (0..63) in position order. */
static void q6k_values(const uint8_t *ql, const uint8_t *qh, uint8_t *v) {
    for (int h = 0; h < 2; h++, ql += 64, qh += 32, v += 128)
        for (int l = 0; l < 32; l++) {
            v[l] = (ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4);
            v[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            v[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            v[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
}

/* Repack ``rows`` rows of ``nb`` raw GGUF blocks each. Returns a status (an unknown type: bad arguments). */
int sp_repack(int type, const uint8_t *raw, void *out, int64_t rows, int64_t nb) {
    if (sp_sizeof_block(type) < 0 || !fits(rows, nb, QK) || !raw || !out) return SP_BAD_ARGUMENTS;
    int64_t total = rows * nb;
    if (type == TYPE_Q4_K) {
        block4 *o = (block4 *)out;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < total; i++) {
            uint8_t v[QK];
            const uint8_t *b = raw + i * 144;
            uint16_t d, dmin;
            memcpy(&d, b, 2);
            memcpy(&dmin, b + 2, 2);
            o[i].d = half_to_float(d);
            o[i].dmin = half_to_float(dmin);
            for (int j = 0; j < 8; j++) scale_min_k4(j, b + 4, &o[i].sc[j], &o[i].m[j]);
            q4k_values(b + 16, v);
            pack_nibbles(v, o[i].qs);
        }
    } else {
        block6 *o = (block6 *)out;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < total; i++) {
            uint8_t v[QK];
            const uint8_t *b = raw + i * 210;
            uint16_t d;
            memcpy(&d, b + 208, 2);
            o[i].d = half_to_float(d);
            memcpy(o[i].sc, b + 192, 16);
            q6k_values(b, b + 128, v);
            uint8_t low[QK];
            for (int p = 0; p < QK; p++) low[p] = v[p] & 0xF;
            pack_nibbles(low, o[i].ql);
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 16; l++) {
                    uint8_t hb = 0;
                    for (int s = 0; s < 4; s++) hb |= (uint8_t)((v[position(qh_byte(c, s, l))] >> 4) << (2 * s));
                    o[i].qh[16 * c + l] = hb;
                }
        }
    }
    return SP_OK;
}

/* A 32-group's values on a fit's grid, q = (x + offset) * inverse rounded to the nearest of 0..15:
 * SSE2 (every x86-64 has it), clamped before the truncation; no library call a value (a draft's fit
 * need not round ties to even as rintf does). */
static void grid32(const float *x, float offset, float inverse, int32_t q[32]) {
    const __m128 o = _mm_set1_ps(offset), inv = _mm_set1_ps(inverse), top = _mm_set1_ps(15.0f), half = _mm_set1_ps(0.5f);
    for (int l = 0; l < 32; l += 4) {
        __m128 v = _mm_mul_ps(_mm_add_ps(_mm_loadu_ps(x + l), o), inv);
        v = _mm_min_ps(_mm_max_ps(v, _mm_setzero_ps()), top); /* a NaN becomes 0 */
        _mm_storeu_si128((__m128i *)(void *)(q + l), _mm_cvttps_epi32(_mm_add_ps(v, half)));
    }
}

/* One 32-group's Q4_K-style fit: value ≈ scale * q - offset, q in 0..15, by a few rounds of least
 * squares from the group's min/max (a draft's weights: any fit is lossless, a closer one drafts better).
 * The sums of q and q*q are integers (exact in any order); that of q*x is taken in 8 lanes. */
static void fit_group(const float *x, float *scale, float *offset) {
    float mn = 0.0f, mx = 0.0f, sx = 0.0f;
    for (int l = 0; l < 32; l++) mn = x[l] < mn ? x[l] : mn, mx = x[l] > mx ? x[l] : mx, sx += x[l];
    float s = (mx - mn) / 15.0f, o = -mn;
    for (int round = 0; round < 3 && s > 0.0f; round++) {
        int32_t q[32], sq = 0, sqq = 0;
        float lanes[8] = {0};
        grid32(x, o, 1.0f / s, q);
        for (int l = 0; l < 32; l++) sq += q[l], sqq += q[l] * q[l];
        for (int j = 0; j < 32; j += 8)
            for (int k = 0; k < 8; k++) lanes[k] += (float)q[j + k] * x[j + k];
        float sqx = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        double det = 32.0 * sqq - (double)sq * sq;
        if (det <= 0) break;
        double ns = (32.0 * sqx - (double)sq * sx) / det, no = (ns * sq - sx) / 32;
        if (ns <= 0 || no < 0) break; /* the offset must stay a non-negative min */
        s = (float)ns, o = (float)no;
    }
    *scale = s, *offset = o;
}

static void fit_block(const float *x, block4 *b);

/* Quantize ``rows`` float rows of ``k`` values (a multiple of 256, row stride ``ldw``) into repacked
 * Q4_K blocks: for a draft model's matrices, which ship in other formats. Returns a status. */
int sp_quantize_q4k(const float *w, int64_t rows, int64_t k, int64_t ldw, block4 *out) {
    if (k < QK || k % QK || ldw < k || !fits(rows, ldw, sizeof(float)) || !w || !out) return SP_BAD_ARGUMENTS;
    int64_t nb = k / QK;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < nb; i++) fit_block(w + r * ldw + i * QK, out + r * nb + i);
    return SP_OK;
}

/* One row of ``width`` values in GGUF's Q8_0 or Q5_0 blocks (32 values each) as floats. */
static void row_values(int type, const uint8_t *raw, int64_t width, float *out) {
    for (int64_t blk = 0; blk < width / 32; blk++) {
        uint16_t h;
        float *y = out + 32 * blk;
        if (type == TYPE_Q8_0) {
            const uint8_t *b = raw + 34 * blk;
            memcpy(&h, b, 2);
            float d = half_to_float(h);
            for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
        } else {
            const uint8_t *b = raw + 22 * blk;
            uint32_t qh;
            memcpy(&h, b, 2);
            memcpy(&qh, b + 2, 4);
            float d = half_to_float(h);
            for (int j = 0; j < 16; j++) {
                int lo = (b[6 + j] & 0xF) | (((qh >> j) & 1) << 4), hi = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
                y[j] = (float)(lo - 16) * d, y[j + 16] = (float)(hi - 16) * d;
            }
        }
    }
}

/* A GGUF matrix of ``rows`` rows of ``width`` values in Q8_0 or Q5_0 blocks, fitted into repacked
 * Q4_K blocks of ``k`` values a row (zeros past ``width``) without a float copy of the matrix.
 * Returns a status: bad arguments for another type or a width not a multiple of 32, out of memory
 * where a thread's row buffer could not be had (some rows are then not fitted). */
int sp_fit_q4k_from(int type, const uint8_t *raw, int64_t rows, int64_t width, int64_t k, block4 *out) {
    if ((type != TYPE_Q8_0 && type != TYPE_Q5_0) || width < 32 || width % 32 || width > k || k % QK ||
        !fits(rows, k, sizeof(float)) || !raw || !out)
        return SP_BAD_ARGUMENTS;
    int64_t nb = k / QK, row_bytes = width / 32 * (type == TYPE_Q8_0 ? 34 : 22);
    int failed = 0;
#pragma omp parallel
    {
        float *row = calloc((size_t)k, sizeof(float));
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!row) continue;
            row_values(type, raw + r * row_bytes, width, row);
            for (int64_t i = 0; i < nb; i++) fit_block(row + i * QK, out + r * nb + i);
        }
        free(row);
    }
    return failed ? SP_OUT_OF_MEMORY : SP_OK;
}

/* 256 floats fitted into one repacked Q4_K block: each 32-group's fit, its scale and offset
 * rounded to 6 bits of the block's largest, the values then rounded on that grid. */
static void fit_block(const float *x, block4 *b) {
    float scale[8], offset[8], smax = 0.0f, omax = 0.0f;
    for (int g = 0; g < 8; g++) {
        fit_group(x + 32 * g, &scale[g], &offset[g]);
        smax = scale[g] > smax ? scale[g] : smax, omax = offset[g] > omax ? offset[g] : omax;
    }
    b->d = smax / 63.0f, b->dmin = omax / 63.0f;
    uint8_t v[QK];
    for (int g = 0; g < 8; g++) {
        int sc = b->d > 0.0f ? (int)lrintf(scale[g] / b->d) : 0, m = b->dmin > 0.0f ? (int)lrintf(offset[g] / b->dmin) : 0;
        b->sc[g] = (uint8_t)(sc > 63 ? 63 : sc), b->m[g] = (uint8_t)(m > 63 ? 63 : m);
        float step = b->d * b->sc[g];
        int32_t q[32];
        grid32(x + 32 * g, b->dmin * b->m[g], step > 0.0f ? 1.0f / step : 0.0f, q);
        for (int l = 0; l < 32; l++) v[32 * g + l] = (uint8_t)q[l];
    }
    pack_nibbles(v, b->qs);
}

/* The high two bits of a Q6_K value at memory byte ``byte`` (the inverse of ``qh_byte``). */
static int q6k_high(const block6 *q, int byte) {
    int h = byte / 128, t = (byte % 128) / 16, c = 2 * (t / 4) + (t % 4) / 2, s = 2 * h + t % 2;
    return (q->qh[16 * c + byte % 16] >> (2 * s)) & 3;
}

/* Rows ``ids`` of a matrix of ``rows`` x ``nb`` repacked blocks as float (an embedding lookup), by
 * GGUF's dequantization formulas. Returns a status: an id outside the rows writes nothing. */
int sp_dequantize_rows(int type, const void *w, int64_t rows, int64_t nb, const int64_t *ids, int64_t n, float *y) {
    if (sp_sizeof_block(type) < 0 || !fits(rows, nb, QK) || !fits(n, nb, QK * sizeof(float)) ||
        (n && (!w || !ids || !y)))
        return SP_BAD_ARGUMENTS;
    for (int64_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= rows) return SP_ID_OUT_OF_RANGE;
    for (int64_t r = 0; r < n; r++) {
        float *out = y + r * nb * QK;
        for (int64_t i = 0; i < nb; i++, out += QK) {
            for (int byte = 0; byte < QK; byte++) {
                int p = position(byte), half = byte / 128, b = byte % 128;
                if (type == TYPE_Q4_K) {
                    const block4 *q = (const block4 *)w + ids[r] * nb + i;
                    int v = (q->qs[b] >> (4 * half)) & 0xF, s = p / 32;
                    out[p] = q->d * q->sc[s] * v - q->dmin * q->m[s];
                } else {
                    const block6 *q = (const block6 *)w + ids[r] * nb + i;
                    int v = (((q->ql[b] >> (4 * half)) & 0xF) | (q6k_high(q, byte) << 4)) - 32;
                    out[p] = q->d * q->sc[p / 16] * v;
                }
            }
        }
    }
    return SP_OK;
}

/* fmaxf(a, b) for an ``a`` that is never NaN, inlined (glibc's is a call): a NaN ``b`` leaves ``a``. */
static inline float larger(float a, float b) { return b > a ? b : a; }

/* One block of 256 values into ``b``, eight at a time: the largest magnitude (NaNs left out, as
 * larger() leaves them), q = value * (127 / that) rounded in the current mode (to even), as lrintf
 * rounds, and clamped to -127..127, a NaN product 0 (lrintf's LONG_MIN cast to int, as this was one
 * value at a time before, through the PLT), q stored in the order of ``position``, the 16-group sums
 * of q. Each product and conversion is the same operation as one value at a time; a maximum and
 * integer sums come out the same in any order. */
__attribute__((target("avx2,fma"))) static void quantize_block(const float *v, blockx *b) {
    __m256 top = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
    for (int l = 0; l < QK; l += 8) top = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + l)), top);
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, top);
    for (int l = 0; l < 8; l++) amax = larger(amax, lanes[l]);
    float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    memset(b, 0, sizeof *b);
    b->d = amax / 127.0f;
    __m256 scale = _mm256_set1_ps(id);
    __m256i most = _mm256_set1_epi32(127), least = _mm256_set1_epi32(-127);
    __m256i q[QK / 8]; /* value order, eight a vector */
    for (int l = 0; l < QK; l += 8) {
        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(v + l), scale);
        __m256i n = _mm256_and_si256(_mm256_cvtps_epi32(x), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q)));
        q[l / 8] = _mm256_max_epi32(_mm256_min_epi32(n, most), least);
    }
    /* The 16-group sums, eight groups at a time: each group's two vectors added, then pairs of lanes. */
    int sums[16];
    for (int s = 0; s < 16; s += 8) {
        __m256i a[8];
        for (int g = 0; g < 8; g++) a[g] = _mm256_add_epi32(q[2 * (s + g)], q[2 * (s + g) + 1]);
        __m256i lo4 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
        __m256i hi4 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
        __m256i low = _mm256_permute2x128_si256(lo4, hi4, 0x20), high = _mm256_permute2x128_si256(lo4, hi4, 0x31);
        _mm256_storeu_si256((__m256i *)(sums + s), _mm256_add_epi32(low, high));
    }
    /* The order of ``position``: bytes 128h + 32p .. + 31 are chunks t = 2p, 2p + 1 of half h, chunk t
     * holding 4-value unit t of each 32-group 4h + i (i = 0..3), unit t being the low (t even) or high
     * 128 bits of vector 16h + 4i + p. Two packs (in range: no saturation) lay them out in that order. */
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 4; p++) {
            __m256i i01 = _mm256_packs_epi32(q[16 * h + p], q[16 * h + 4 + p]);
            __m256i i23 = _mm256_packs_epi32(q[16 * h + 8 + p], q[16 * h + 12 + p]);
            _mm256_storeu_si256((__m256i *)(void *)(b->q + 128 * h + 32 * p), _mm256_packs_epi16(i01, i23));
        }
    for (int i4 = 0; i4 < 4; i4++) {
        for (int e = 0; e < 2; e++) b->xmin[e][i4] = b->d * (float)(sums[8 * e + 2 * i4] + sums[8 * e + 2 * i4 + 1]);
        for (int hu = 0; hu < 4; hu++) b->neg32[hu][i4] = -32 * sums[8 * (hu / 2) + 2 * i4 + hu % 2];
    }
}

/* Quantize rows of x (``m`` x ``width``, row stride ``ldx``) into blocks of 256, the values from
 * ``width`` up to ``k`` (a multiple of 256) taken as zeros. Shares the blocks among the threads of
 * the parallel region it is called in (a lone row's too: each block depends on its own values alone).
 * Its callers run on the AVX2 path or the AVX-512 one, so on a CPU with AVX2. */
void sp_quantize_rows(const float *x, int64_t m, int64_t k, int64_t width, int64_t ldx, blockx *out) {
    int64_t nb = k / QK;
#pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        for (int64_t i = 0; i < nb; i++) {
            float padded[QK];
            const float *v = x + r * ldx + i * QK;
            if ((i + 1) * QK > width) { /* the last block of a row that is not whole */
                int64_t have = width - i * QK;
                memset(padded, 0, sizeof padded);
                if (have > 0) memcpy(padded, v, (size_t)have * sizeof(float));
                v = padded;
            }
            quantize_block(v, out + r * nb + i);
        }
    }
}
