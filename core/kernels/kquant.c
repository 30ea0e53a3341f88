/* SpecPlay's exact k-quant kernel: y = x W^T for weights in GGUF's Q4_K and Q6_K blocks.
 *
 * Batch-invariant by construction: the result for one row of x never depends on how many rows
 * share the call, on the thread count or on the instruction set chosen at run time.
 *
 * - Activations are quantized per row, per block of 256 (one float scale each, like GGUF's
 *   Q8_K), so a row's integers depend on that row alone.
 * - Inside a 256-weight block every product and sum is an integer (exact in any order). Weights
 *   are unsigned (Q4_K's 0..15, Q6_K's 0..63), activations in -127..127, so the 16-bit pair sums
 *   of vpmaddubsw stay below 2 * 63 * 127 = 16002 and never saturate.
 * - Each output's float work is one fixed sequence of vector-lane operations (the same on every
 *   path and tile size, compiled with -ffp-contract=off: no FMA that one path would contract and
 *   another not), blocks in ascending order, its four lanes summed at the end in one fixed order.
 * - Threads split the outputs (columns), never the sum over K: every output is one thread's.
 *
 * Weights are repacked once at load, keeping their values exactly: Q4_K's half-precision d and
 * dmin as float, its 6-bit scales and mins as bytes; Q6_K's d as float, its bits as they are.
 * Each weight row (an output column) keeps its blocks contiguous, so the first r rows of a
 * matrix are a matrix of r rows (a cut LM head).
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 256

enum { TYPE_Q4_K = 12, TYPE_Q6_K = 14 }; /* GGML's type numbers */

/* What every entry returns: 0, or why it did nothing useful (its outputs are then to be thrown
 * away). Each checks its arguments before it reads or writes anything: they come from a model
 * file, and a file's numbers are a stranger's. kquant_layer.c uses the same codes. */
enum { SP_OK = 0, SP_BAD_ARGUMENTS = -1, SP_OUT_OF_MEMORY = -2, SP_ID_OUT_OF_RANGE = -3 };

/* Whether ``a`` * ``b`` * ``c`` (``c`` > 0) is a count of non-negative factors that fits in int64. */
static int fits(int64_t a, int64_t b, int64_t c) { return a >= 0 && b >= 0 && (b == 0 || a <= INT64_MAX / b / c); }

/* The order of a block's 256 positions in memory, for weights and activations alike. Byte
 * 128h + 16t + 4i + j (half h = 0..1, chunk t = 0..7, slot i = 0..3, j = 0..3) holds position
 * 128h + 32i + 4t + j. The kernel puts four columns side by side in one 512-bit vector (one
 * 128-bit lane each) and multiplies a weight chunk by the same 16 activation bytes in every lane:
 * a vpdpbusd lane (column, slot i) then sums four products of 32-group 4h + i, so the eight chunks
 * of a half leave each group's integer sum in its own lane, ready for its column's scale. */
static inline int position(int byte) {
    return 128 * (byte / 128) + 32 * ((byte % 16) / 4) + 4 * ((byte % 128) / 16) + byte % 4;
}

/* One block of 256 activations of one row: ``value ≈ d * q``, q in the order of ``position``.
 * ``xmin[e][i]`` is ``d`` times the sum of q over 32-group 4e + i (what Q4_K's mins multiply);
 * ``neg32[2h + u][i]`` is -32 times the sum over 16-group 8h + 2i + u (Q6_K's offset of 32). */
typedef struct {
    int8_t q[QK];
    int32_t neg32[4][4];
    float xmin[2][4];
    float d;
    float pad[3];
} blockx;

typedef struct { /* Q4_K: value = d * sc[g] * q - dmin * m[g] in 32-group g */
    uint8_t sc[8], m[8];
    float d, dmin;
    uint8_t qs[128]; /* byte b: low nibble at memory byte b, high nibble at byte b + 128 */
} block4;

typedef struct { /* Q6_K: value = d * sc[g] * (q - 32) in 16-group g */
    int8_t sc[16];
    float d;
    uint8_t ql[128]; /* q's low four bits, packed as Q4_K's */
    uint8_t qh[64];  /* q's high two bits: bits 2s, 2s+1 of byte 16c + l for memory byte qh_byte(c, s, l) */
} block6;

/* Q6_K's high bits: chunk c (0..3) of qh, bit pair s (0..3), byte l (0..15) of the chunk belong
 * to memory byte 128h + 16t + l with h = s/2 and t = 4(c/2) + 2(c%2) + s%2, so the kernel's two
 * passes (chunks t = 0..3, then 4..7) each read the qh chunks 2z and 2z + 1 alone. */
static inline int qh_byte(int c, int s, int l) { return 128 * (s / 2) + 16 * (4 * (c / 2) + 2 * (c % 2) + s % 2) + l; }

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

enum { TYPE_Q5_0 = 6, TYPE_Q8_0 = 8 }; /* GGML's type numbers of the draft's other blocks */

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

/* Quantize rows of x (``m`` x ``width``, row stride ``ldx``) into blocks of 256, row by row, the
 * values from ``width`` up to ``k`` (a multiple of 256) taken as zeros. Shares the outputs among
 * the threads of the parallel region it is called in. */
void sp_quantize_rows(const float *x, int64_t m, int64_t k, int64_t width, int64_t ldx, blockx *out) {
    int64_t nb = k / QK;
#pragma omp for schedule(static)
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
            blockx *b = out + r * nb + i;
            float amax = 0.0f;
            for (int l = 0; l < QK; l++) amax = fmaxf(amax, fabsf(v[l]));
            float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            memset(b, 0, sizeof *b);
            b->d = amax / 127.0f;
            int sums[16] = {0};
            for (int byte = 0; byte < QK; byte++) {
                int p = position(byte);
                int q = (int)lrintf(v[p] * id);
                q = q > 127 ? 127 : q < -127 ? -127 : q;
                b->q[byte] = (int8_t)q;
                sums[p / 16] += q;
            }
            for (int i4 = 0; i4 < 4; i4++) {
                for (int e = 0; e < 2; e++) b->xmin[e][i4] = b->d * (float)(sums[8 * e + 2 * i4] + sums[8 * e + 2 * i4 + 1]);
                for (int hu = 0; hu < 4; hu++) b->neg32[hu][i4] = -32 * sums[8 * (hu / 2) + 2 * i4 + hu % 2];
            }
        }
    }
}

/* ---- The dot products. Four columns (weight rows) share a 512-bit vector, one 128-bit lane
 * each, and a tile of R rows shares every decoded weight chunk. Each output (row, column) sees
 * one float sequence on every path and tile size (8, 4, 2 or 1 rows, chosen by how many rows are
 * left), in its four slot lanes, block after block (G: a lane's integer sum over one group):
 *   Q4_K: u = float(G0) * (d sc0); u += float(G1) * (d sc1); acc += u * xd;
 *         acc -= (dmin m0) * xmin0; acc -= (dmin m1) * xmin1
 *   Q6_K: u = float(G00) * (d sc00); u += float(G10) * (d sc10); u += ... G01, G11; acc += u * xd
 * then (s0 + s1) + (s2 + s3) over the slots. R therefore never changes a row's result; the tests
 * prove it for every M from 1 to 65. The AVX-512 path reads Q4_K's high nibbles in place, as 16
 * times their value, and multiplies their sum by (d sc1) / 16: exact scalings by 16, so the same
 * products bit for bit (AVX2's vpmaddubsw would saturate on them, so it shifts them down). */

#define AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma"
#define INLINE static inline __attribute__((always_inline))
#define ROWS_MAX 8
#define KEPT 20 /* vectors of a decoded block: 16 weight chunks, 4 of scales */
#define KEEP_BLOCKS 64
enum { DIRECT, SAVE, LOAD }; /* where a tile's decoded blocks come from and go */

/* pshufb patterns (per 128-bit lane) that pick a block's scales for the slots: Q4_K's sc[i] and
 * sc[4 + i], m[i] and m[4 + i] as int32; Q6_K's sc[8h + 2i + u] into the top byte (for its sign). */
static const int8_t PICK_SC_LO[16] = {0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1};
static const int8_t PICK_SC_HI[16] = {4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1};
static const int8_t PICK_MIN_LO[16] = {8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1};
static const int8_t PICK_MIN_HI[16] = {12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1};
static const int8_t PICK_SC6[4][16] = {{-1, -1, -1, 0, -1, -1, -1, 2, -1, -1, -1, 4, -1, -1, -1, 6},
                                       {-1, -1, -1, 1, -1, -1, -1, 3, -1, -1, -1, 5, -1, -1, -1, 7},
                                       {-1, -1, -1, 8, -1, -1, -1, 10, -1, -1, -1, 12, -1, -1, -1, 14},
                                       {-1, -1, -1, 9, -1, -1, -1, 11, -1, -1, -1, 13, -1, -1, -1, 15}};

#define LOAD128(p) _mm_loadu_si128((const __m128i *)(const void *)(p))

/* 16 bytes at ``off`` in each of four columns' blocks, one column per 128-bit lane. */
__attribute__((target(AVX512))) INLINE __m512i lanes4(const uint8_t *const c[4], int64_t off) {
    __m512i v = _mm512_castsi128_si512(LOAD128(c[0] + off));
    v = _mm512_inserti32x4(v, LOAD128(c[1] + off), 1);
    v = _mm512_inserti32x4(v, LOAD128(c[2] + off), 2);
    return _mm512_inserti32x4(v, LOAD128(c[3] + off), 3);
}

/* Chunks t = 0..3 (64 bytes at ``off``) of four columns, transposed: a[t] holds chunk t of each. */
__attribute__((target(AVX512))) INLINE void chunks4(const uint8_t *const c[4], int64_t off, __m512i a[4]) {
    __m512i v[4];
    for (int k = 0; k < 4; k++) v[k] = _mm512_loadu_si512((const void *)(c[k] + off));
    __m512i t0 = _mm512_shuffle_i64x2(v[0], v[1], 0x44), t1 = _mm512_shuffle_i64x2(v[0], v[1], 0xEE);
    __m512i t2 = _mm512_shuffle_i64x2(v[2], v[3], 0x44), t3 = _mm512_shuffle_i64x2(v[2], v[3], 0xEE);
    a[0] = _mm512_shuffle_i64x2(t0, t2, 0x88);
    a[1] = _mm512_shuffle_i64x2(t0, t2, 0xDD);
    a[2] = _mm512_shuffle_i64x2(t1, t3, 0x88);
    a[3] = _mm512_shuffle_i64x2(t1, t3, 0xDD);
}

/* Chunks 2z and 2z + 1 of four columns' Q6_K high bits (32 bytes at ``off``), transposed. */
__attribute__((target(AVX512))) INLINE void chunks2(const uint8_t *const c[4], int64_t off, __m512i a[2]) {
    __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(c[0] + off))),
                                    _mm256_loadu_si256((const __m256i *)(c[1] + off)), 1);
    __m512i cd = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(c[2] + off))),
                                    _mm256_loadu_si256((const __m256i *)(c[3] + off)), 1);
    a[0] = _mm512_shuffle_i64x2(ab, cd, 0x88);
    a[1] = _mm512_shuffle_i64x2(ab, cd, 0xDD);
}

__attribute__((target(AVX512))) INLINE __m512i bcast512(const void *p) { return _mm512_broadcast_i32x4(LOAD128(p)); }

/* Bits 2s, 2s+1 of every byte moved to bits 4, 5 (the rest is masked off by the caller). */
__attribute__((target(AVX512))) INLINE __m512i high512(__m512i v, int s) {
    return s == 0 ? _mm512_slli_epi16(v, 4) : s == 1 ? _mm512_slli_epi16(v, 2) : s == 2 ? v : _mm512_srli_epi16(v, 2);
}

/* Asks for the cache lines of each column's block AHEAD bytes on (past a column's end, the next
 * group's column, which this thread takes next). A tile of several rows computes long enough per block
 * that the hardware's prefetcher falls behind the weights' stream; a lone row is the stream alone, and
 * runs without it (measured in docs/benchmarks.md). A prefetch past the last matrix never faults. */
#define AHEAD 1024
INLINE void ahead(const uint8_t *const *w, const int columns, int64_t size) {
    _Pragma("GCC unroll 8") for (int k = 0; k < columns; k++)
        for (int64_t line = 0; line < size; line += 64) _mm_prefetch((const char *)w[k] + AHEAD + line, _MM_HINT_T0);
}

/* A row's four slot sums per column, (s0 + s1) + (s2 + s3), stored for the ``ncols`` real columns
 * (``step`` outputs apart). */
__attribute__((target(AVX512))) INLINE void store512(__m512 v, float *y, int64_t step, int ncols) {
    float o[16];
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));
    _mm512_storeu_ps(o, _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E)));
    for (int i = 0; i < ncols; i++) y[i * step] = o[4 * i];
}

__attribute__((target(AVX512))) INLINE void q4_tile512(const uint8_t *const col[4], int64_t nb, const blockx *x,
                                                       float *y, int64_t ldy, int64_t step, int ncols, const int R,
                                                       __m512i *keep, const int mode) {
    const __m512i m4 = _mm512_set1_epi8(0xF), mf0 = _mm512_set1_epi8((char)0xF0), lo = bcast512(PICK_SC_LO),
                  hi = bcast512(PICK_SC_HI), mlo = bcast512(PICK_MIN_LO), mhi = bcast512(PICK_MIN_HI);
    __m512 acc[ROWS_MAX];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w[4];
        _Pragma("GCC unroll 8") for (int k = 0; k < 4; k++) w[k] = col[k] + b * (int64_t)sizeof(block4);
        if (mode != LOAD && R > 1) ahead(w, 4, sizeof(block4));
        __m512i *kb = keep + KEPT * b;
        __m512 slo, shi, wlo, whi;
        if (mode == LOAD) {
            slo = _mm512_castsi512_ps(kb[16]), shi = _mm512_castsi512_ps(kb[17]);
            wlo = _mm512_castsi512_ps(kb[18]), whi = _mm512_castsi512_ps(kb[19]);
        } else {
            __m512i sm = lanes4(w, offsetof(block4, sc));
            __m512 dd = _mm512_castsi512_ps(lanes4(w, offsetof(block4, d)));
            __m512 d = _mm512_permute_ps(dd, 0x00), dmin = _mm512_permute_ps(dd, 0x55);
            slo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(sm, lo)), d);
            shi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(sm, hi)), _mm512_mul_ps(d, _mm512_set1_ps(0.0625f)));
            wlo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(sm, mlo)), dmin);
            whi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(sm, mhi)), dmin);
            if (mode == SAVE) {
                kb[16] = _mm512_castps_si512(slo), kb[17] = _mm512_castps_si512(shi);
                kb[18] = _mm512_castps_si512(wlo), kb[19] = _mm512_castps_si512(whi);
            }
        }
        __m512i g0[ROWS_MAX], g1[ROWS_MAX], e0 = _mm512_setzero_si512(), e1 = e0;
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) g0[r] = g1[r] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int z = 0; z < 2; z++) {
            __m512i p[4];
            if (mode != LOAD) chunks4(w, offsetof(block4, qs) + 64 * z, p);
            _Pragma("GCC unroll 8") for (int u = 0; u < 4; u++) {
                int t = 4 * z + u;
                __m512i wl, wh;
                if (mode == LOAD) {
                    wl = kb[t], wh = kb[8 + t];
                } else {
                    wl = _mm512_and_si512(p[u], m4), wh = _mm512_and_si512(p[u], mf0);
                    if (mode == SAVE) kb[t] = wl, kb[8 + t] = wh;
                }
                if (R == 1 && u % 2) { /* a lone row: two chains per sum, for the latency */
                    const int8_t *q = x[b].q;
                    e0 = _mm512_dpbusd_epi32(e0, wl, bcast512(q + 16 * t));
                    e1 = _mm512_dpbusd_epi32(e1, wh, bcast512(q + 128 + 16 * t));
                    continue;
                }
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
                    const int8_t *q = x[r * nb + b].q;
                    g0[r] = _mm512_dpbusd_epi32(g0[r], wl, bcast512(q + 16 * t));
                    g1[r] = _mm512_dpbusd_epi32(g1[r], wh, bcast512(q + 128 + 16 * t));
                }
            }
        }
        if (R == 1) g0[0] = _mm512_add_epi32(g0[0], e0), g1[0] = _mm512_add_epi32(g1[0], e1);
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
            const blockx *xb = x + r * nb + b;
            __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(g0[r]), slo);
            u = _mm512_fmadd_ps(_mm512_cvtepi32_ps(g1[r]), shi, u);
            acc[r] = _mm512_fmadd_ps(u, _mm512_set1_ps(xb->d), acc[r]);
            acc[r] = _mm512_fnmadd_ps(wlo, _mm512_broadcast_f32x4(_mm_loadu_ps(xb->xmin[0])), acc[r]);
            acc[r] = _mm512_fnmadd_ps(whi, _mm512_broadcast_f32x4(_mm_loadu_ps(xb->xmin[1])), acc[r]);
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) store512(acc[r], y + r * ldy, step, ncols);
}

__attribute__((target(AVX512))) INLINE void q6_tile512(const uint8_t *const col[4], int64_t nb, const blockx *x,
                                                       float *y, int64_t ldy, int64_t step, int ncols, const int R,
                                                       __m512i *keep, const int mode) {
    const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
    __m512 acc[ROWS_MAX];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w[4];
        _Pragma("GCC unroll 8") for (int k = 0; k < 4; k++) w[k] = col[k] + b * (int64_t)sizeof(block6);
        if (mode != LOAD && R > 1) ahead(w, 4, sizeof(block6));
        __m512i *kb = keep + KEPT * b;
        __m512 s[4];
        if (mode == LOAD) {
            _Pragma("GCC unroll 8") for (int hu = 0; hu < 4; hu++) s[hu] = _mm512_castsi512_ps(kb[16 + hu]);
        } else {
            __m512i sc = lanes4(w, offsetof(block6, sc));
            __m512 d = _mm512_permute_ps(_mm512_castsi512_ps(lanes4(w, offsetof(block6, d))), 0x00);
            _Pragma("GCC unroll 8") for (int hu = 0; hu < 4; hu++) {
                s[hu] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_shuffle_epi8(sc, bcast512(PICK_SC6[hu])), 24)), d);
                if (mode == SAVE) kb[16 + hu] = _mm512_castps_si512(s[hu]);
            }
        }
        __m512 u[ROWS_MAX];
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) u[r] = _mm512_setzero_ps();
        _Pragma("GCC unroll 8") for (int z = 0; z < 2; z++) {
            __m512i p[4], h[2], g0[ROWS_MAX], g1[ROWS_MAX];
            if (mode != LOAD) {
                chunks4(w, offsetof(block6, ql) + 64 * z, p);
                chunks2(w, offsetof(block6, qh) + 32 * z, h);
            }
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
                g0[r] = bcast512(x[r * nb + b].neg32[z]);
                g1[r] = bcast512(x[r * nb + b].neg32[2 + z]);
            }
            _Pragma("GCC unroll 8") for (int v = 0; v < 4; v++) {
                int t = 4 * z + v;
                __m512i wl, wh;
                if (mode == LOAD) {
                    wl = kb[t], wh = kb[8 + t];
                } else {
                    wl = _mm512_ternarylogic_epi32(_mm512_and_si512(p[v], m4), high512(h[v / 2], v % 2), m30, 0xF8);
                    wh = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(p[v], 4), m4),
                                                   high512(h[v / 2], 2 + v % 2), m30, 0xF8);
                    if (mode == SAVE) kb[t] = wl, kb[8 + t] = wh;
                }
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
                    const int8_t *q = x[r * nb + b].q;
                    g0[r] = _mm512_dpbusd_epi32(g0[r], wl, bcast512(q + 16 * t));
                    g1[r] = _mm512_dpbusd_epi32(g1[r], wh, bcast512(q + 128 + 16 * t));
                }
            }
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
                __m512 f = _mm512_cvtepi32_ps(g0[r]);
                u[r] = z == 0 ? _mm512_mul_ps(f, s[0]) : _mm512_fmadd_ps(f, s[1], u[r]);
                u[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(g1[r]), s[2 + z], u[r]);
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(u[r], _mm512_set1_ps(x[r * nb + b].d), acc[r]);
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) store512(acc[r], y + r * ldy, step, ncols);
}

/* AVX2 + FMA: the same layout and float sequence, two columns per 256-bit vector; without VNNI,
 * vpmaddubsw's pair sums (below 2 * 63 * 127, no saturation) and vpmaddwd by ones make each
 * lane's four-product sum. */
#define AVX2 "avx2,fma"

__attribute__((target(AVX2))) INLINE __m256i lanes2(const uint8_t *const c[2], int64_t off) {
    return _mm256_loadu2_m128i((const __m128i *)(const void *)(c[1] + off), (const __m128i *)(const void *)(c[0] + off));
}

__attribute__((target(AVX2))) INLINE __m256i bcast256(const void *p) { return _mm256_broadcastsi128_si256(LOAD128(p)); }

__attribute__((target(AVX2))) INLINE __m256i dot256(__m256i acc, __m256i w, const void *x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, bcast256(x)), _mm256_set1_epi16(1)));
}

__attribute__((target(AVX2))) INLINE __m256i high256(__m256i v, int s) {
    return s == 0 ? _mm256_slli_epi16(v, 4) : s == 1 ? _mm256_slli_epi16(v, 2) : s == 2 ? v : _mm256_srli_epi16(v, 2);
}

__attribute__((target(AVX2))) INLINE void store256(__m256 v, float *y, int64_t step, int ncols) {
    float o[8];
    v = _mm256_add_ps(v, _mm256_permute_ps(v, 0xB1));
    _mm256_storeu_ps(o, _mm256_add_ps(v, _mm256_permute_ps(v, 0x4E)));
    for (int i = 0; i < ncols; i++) y[i * step] = o[4 * i];
}

__attribute__((target(AVX2))) INLINE void q4_tile256(const uint8_t *const col[2], int64_t nb, const blockx *x,
                                                     float *y, int64_t ldy, int64_t step, int ncols, const int R) {
    const __m256i m4 = _mm256_set1_epi8(0xF), lo = bcast256(PICK_SC_LO),
                  hi = bcast256(PICK_SC_HI), mlo = bcast256(PICK_MIN_LO), mhi = bcast256(PICK_MIN_HI);
    __m256 acc[ROWS_MAX];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w[2];
        _Pragma("GCC unroll 8") for (int k = 0; k < 2; k++) w[k] = col[k] + b * (int64_t)sizeof(block4);
        if (R > 1) ahead(w, 2, sizeof(block4));
        __m256i sm = lanes2(w, offsetof(block4, sc));
        __m256 dd = _mm256_castsi256_ps(lanes2(w, offsetof(block4, d)));
        __m256 d = _mm256_permute_ps(dd, 0x00), dmin = _mm256_permute_ps(dd, 0x55);
        __m256 slo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(sm, lo)), d);
        __m256 shi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(sm, hi)), d);
        __m256 wlo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(sm, mlo)), dmin);
        __m256 whi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(sm, mhi)), dmin);
        __m256i g0[ROWS_MAX], g1[ROWS_MAX];
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) g0[r] = g1[r] = _mm256_setzero_si256();
        _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) {
            __m256i p = lanes2(w, offsetof(block4, qs) + 16 * t);
            __m256i wl = _mm256_and_si256(p, m4), wh = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
                const int8_t *q = x[r * nb + b].q;
                g0[r] = dot256(g0[r], wl, q + 16 * t);
                g1[r] = dot256(g1[r], wh, q + 128 + 16 * t);
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
            const blockx *xb = x + r * nb + b;
            __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(g0[r]), slo);
            u = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g1[r]), shi, u);
            acc[r] = _mm256_fmadd_ps(u, _mm256_set1_ps(xb->d), acc[r]);
            acc[r] = _mm256_fnmadd_ps(wlo, _mm256_broadcast_ps((const __m128 *)xb->xmin[0]), acc[r]);
            acc[r] = _mm256_fnmadd_ps(whi, _mm256_broadcast_ps((const __m128 *)xb->xmin[1]), acc[r]);
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) store256(acc[r], y + r * ldy, step, ncols);
}

__attribute__((target(AVX2))) INLINE void q6_tile256(const uint8_t *const col[2], int64_t nb, const blockx *x,
                                                     float *y, int64_t ldy, int64_t step, int ncols, const int R) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[ROWS_MAX];
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w[2];
        _Pragma("GCC unroll 8") for (int k = 0; k < 2; k++) w[k] = col[k] + b * (int64_t)sizeof(block6);
        if (R > 1) ahead(w, 2, sizeof(block6));
        __m256i sc = lanes2(w, offsetof(block6, sc));
        __m256 d = _mm256_permute_ps(_mm256_castsi256_ps(lanes2(w, offsetof(block6, d))), 0x00), s[4];
        _Pragma("GCC unroll 8") for (int hu = 0; hu < 4; hu++)
            s[hu] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_shuffle_epi8(sc, bcast256(PICK_SC6[hu])), 24)), d);
        __m256 u[ROWS_MAX];
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) u[r] = _mm256_setzero_ps();
        _Pragma("GCC unroll 8") for (int z = 0; z < 2; z++) {
            __m256i g0[ROWS_MAX], g1[ROWS_MAX];
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
                g0[r] = bcast256(x[r * nb + b].neg32[z]);
                g1[r] = bcast256(x[r * nb + b].neg32[2 + z]);
            }
            _Pragma("GCC unroll 8") for (int v = 0; v < 4; v++) {
                int t = 4 * z + v;
                __m256i p = lanes2(w, offsetof(block6, ql) + 16 * t), h = lanes2(w, offsetof(block6, qh) + 16 * (2 * z + v / 2));
                __m256i wl = _mm256_or_si256(_mm256_and_si256(p, m4), _mm256_and_si256(high256(h, v % 2), m30));
                __m256i wh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p, 4), m4),
                                             _mm256_and_si256(high256(h, 2 + v % 2), m30));
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
                    const int8_t *q = x[r * nb + b].q;
                    g0[r] = dot256(g0[r], wl, q + 16 * t);
                    g1[r] = dot256(g1[r], wh, q + 128 + 16 * t);
                }
            }
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
                __m256 f = _mm256_cvtepi32_ps(g0[r]);
                u[r] = z == 0 ? _mm256_mul_ps(f, s[0]) : _mm256_fmadd_ps(f, s[1], u[r]);
                u[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g1[r]), s[2 + z], u[r]);
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(u[r], _mm256_set1_ps(x[r * nb + b].d), acc[r]);
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) store256(acc[r], y + r * ldy, step, ncols);
}

/* The columns go in groups of ``width``, ``groups`` apart (group g: columns g, g + groups, ...;
 * a column past ``n`` repeats the last one and is not stored), so each lane of a group streams its
 * own quarter (half) of the weights from memory, one after the other as g grows, which the
 * hardware prefetcher follows far better than neighbouring columns sharing a page. Returns the
 * group's real columns. */
static int group_columns(const void *w, int64_t n, int64_t stride, int64_t groups, int64_t g, int width,
                         const uint8_t **c) {
    int ncols = 0;
    for (int i = 0; i < width; i++) {
        int64_t col = g + i * groups < n ? g + i * groups : n - 1;
        ncols += g + i * groups < n;
        c[i] = (const uint8_t *)w + col * stride;
    }
    return ncols;
}

/* Rows go in tiles of ``widest``, the rest in one tile of their own: every tile streams the weights
 * once (tiles of 4, 2, 1 for the rest made 3 rows cost more than 4 and 7 more than 8). */
static int tile_rows(int64_t left, int widest) { return left >= widest ? widest : (int)left; }

#define TILE_SIZES(FN, MODE)                                                                              \
    do {                                                                                                  \
        switch (R) {                                                                                      \
        case 8: FN(c, nb, x, y, ldy, step, ncols, 8, keep, MODE); break;                                  \
        case 7: FN(c, nb, x, y, ldy, step, ncols, 7, keep, MODE); break;                                  \
        case 6: FN(c, nb, x, y, ldy, step, ncols, 6, keep, MODE); break;                                  \
        case 5: FN(c, nb, x, y, ldy, step, ncols, 5, keep, MODE); break;                                  \
        case 4: FN(c, nb, x, y, ldy, step, ncols, 4, keep, MODE); break;                                  \
        case 3: FN(c, nb, x, y, ldy, step, ncols, 3, keep, MODE); break;                                  \
        case 2: FN(c, nb, x, y, ldy, step, ncols, 2, keep, MODE); break;                                  \
        default: FN(c, nb, x, y, ldy, step, ncols, 1, keep, MODE);                                        \
        }                                                                                                 \
    } while (0)

__attribute__((target(AVX512))) static void tile_512(int type, const uint8_t *const c[4], int64_t nb, const blockx *x,
                                                     float *y, int64_t ldy, int64_t step, int ncols, int R,
                                                     __m512i *keep, int mode) {
    if (type == TYPE_Q4_K) {
        if (mode == SAVE) q4_tile512(c, nb, x, y, ldy, step, ncols, 8, keep, SAVE);
        else if (mode == LOAD) TILE_SIZES(q4_tile512, LOAD);
        else TILE_SIZES(q4_tile512, DIRECT);
    } else {
        if (mode == SAVE) q6_tile512(c, nb, x, y, ldy, step, ncols, 8, keep, SAVE);
        else if (mode == LOAD) TILE_SIZES(q6_tile512, LOAD);
        else TILE_SIZES(q6_tile512, DIRECT);
    }
}

/* With more than one tile of rows, the first keeps its decoded blocks (the same values) for the
 * others, where a group's blocks fit: up to KEEP_BLOCKS blocks of KEPT vectors each. */
__attribute__((target(AVX512))) static void gemm_512(int type, const void *w, int64_t n, int64_t k, const blockx *x,
                                                     int64_t m, float *y, int64_t ldy) {
    int64_t nb = k / QK, stride = nb * sp_sizeof_block(type), groups = (n + 3) / 4;
    int keeps = m > 8 && nb <= KEEP_BLOCKS;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        __m512i keep[KEPT * KEEP_BLOCKS];
        const uint8_t *c[4];
        int ncols = group_columns(w, n, stride, groups, g, 4, c);
        for (int64_t r = 0; r < m;) {
            int R = tile_rows(m - r, 8), mode = !keeps ? DIRECT : r == 0 ? SAVE : LOAD;
            tile_512(type, c, nb, x + r * nb, y + r * ldy + g, ldy, groups, ncols, R, keep, mode);
            r += R;
        }
    }
}

#define TILE_SIZES_256(FN)                                                                                \
    do {                                                                                                  \
        switch (R) {                                                                                      \
        case 4: FN(c, nb, x, y, ldy, step, ncols, 4); break;                                              \
        case 3: FN(c, nb, x, y, ldy, step, ncols, 3); break;                                              \
        case 2: FN(c, nb, x, y, ldy, step, ncols, 2); break;                                              \
        default: FN(c, nb, x, y, ldy, step, ncols, 1);                                                    \
        }                                                                                                 \
    } while (0)

__attribute__((target(AVX2))) static void tile_256(int type, const uint8_t *const c[2], int64_t nb, const blockx *x,
                                                   float *y, int64_t ldy, int64_t step, int ncols, int R) {
    if (type == TYPE_Q4_K) TILE_SIZES_256(q4_tile256);
    else TILE_SIZES_256(q6_tile256);
}

__attribute__((target(AVX2))) static void gemm_256(int type, const void *w, int64_t n, int64_t k, const blockx *x,
                                                   int64_t m, float *y, int64_t ldy) {
    int64_t nb = k / QK, stride = nb * sp_sizeof_block(type), groups = (n + 1) / 2;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *c[2];
        int ncols = group_columns(w, n, stride, groups, g, 2, c);
        for (int64_t r = 0; r < m;) {
            int R = tile_rows(m - r, 4);
            tile_256(type, c, nb, x + r * nb, y + r * ldy + g, ldy, groups, ncols, R);
            r += R;
        }
    }
}

/* y[:, :n] (row stride ``ldy``) = quantized rows ``x`` times the ``n`` weight rows ``w``, on the
 * path ``isa`` names (2: AVX2 + FMA; 3: AVX-512 F, BW, VL, DQ with VNNI), its columns shared among
 * the threads of the region it runs in. */
void sp_gemm_rows(int isa, int type, const void *w, int64_t n, int64_t k, const blockx *x, int64_t m, float *y,
                  int64_t ldy) {
    if (isa == 3)
        gemm_512(type, w, n, k, x, m, y, ldy);
    else
        gemm_256(type, w, n, k, x, m, y, ldy);
}

/* A whole layer in one parallel region: rows ``x`` (``m`` x ``width``, stride ``ldx``) quantized
 * into ``xq`` (``m`` x ``k / 256`` blocks, zeros past ``width``), then multiplied by ``parts``
 * weight matrices (``types[i]``, ``ws[i]``, ``ns[i]`` rows of ``k`` values), their outputs side by
 * side in ``y`` (row stride ``ldy``). One region instead of one per step: each costs a wake-up of
 * the threads, a third of a small draft layer's time. Returns a status. */
int sp_linear(int isa, int parts, const int *types, const void *const *ws, const int64_t *ns, int64_t k,
              int64_t width, const float *x, int64_t m, int64_t ldx, blockx *xq, float *y, int64_t ldy) {
    if ((isa != 2 && isa != 3) || parts < 1 || !types || !ws || !ns || k < QK || k % QK || width < 1 ||
        width > k || ldx < width || !fits(m, ldx, sizeof(float)) || !fits(m, k, sizeof(blockx)) ||
        (m && (!x || !xq || !y)))
        return SP_BAD_ARGUMENTS;
    int64_t out = 0;
    for (int i = 0; i < parts; i++) {
        if (sp_sizeof_block(types[i]) < 0 || ns[i] < 0 || ns[i] > INT64_MAX - out || (ns[i] && !ws[i]))
            return SP_BAD_ARGUMENTS;
        out += ns[i];
    }
    if (ldy < out || !fits(m, ldy, sizeof(float))) return SP_BAD_ARGUMENTS;
#pragma omp parallel
    {
        sp_quantize_rows(x, m, k, width, ldx, xq);
        int64_t col = 0;
        for (int i = 0; i < parts; col += ns[i], i++) sp_gemm_rows(isa, types[i], ws[i], ns[i], k, xq, m, y + col, ldy);
    }
    return SP_OK;
}
