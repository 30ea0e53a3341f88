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
 * - Each block's integer sum becomes float once, and an output's blocks are added in ascending
 *   order by the same scalar code on every path (compiled with -ffp-contract=off: no FMA that
 *   one path would contract and another not).
 * - Threads split the outputs (columns), never the sum over K: every output is one thread's.
 *
 * Weights are repacked once at load, keeping their values exactly: Q4_K's half-precision d and
 * dmin as float, its 6-bit scales and mins as bytes; Q6_K's d as float, its bits as they are.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define QK 256

enum { TYPE_Q4_K = 12, TYPE_Q6_K = 14 }; /* GGML's type numbers */

/* The order of a block's 256 positions in memory, for weights and activations alike: byte
 * 64t + 4j + i holds position 16j + 4t + i (chunk t = 0..3, lane j = 0..15, i = 0..3). One
 * vpdpbusd over chunk t then adds four products of group j (positions 16j .. 16j+15) into lane
 * j, so four of them leave each group's whole integer sum in its own lane, ready for its scale. */
static inline int position(int byte) { return 16 * ((byte % 64) / 4) + 4 * (byte / 64) + byte % 4; }

/* One block of 256 activations of one row: ``value ≈ d * q``; ``bsum[j]`` is ``d`` times the
 * sum of q over group j (the part the weights' offsets multiply). */
typedef struct {
    float d;
    int8_t q[QK];
    float bsum[16];
} blockx;

typedef struct { /* Q4_K: value = d * sc[g/2] * q - dmin * m[g/2] in group g (of 16 positions) */
    float d, dmin;
    uint8_t sc[8], m[8];
    uint8_t qs[128]; /* byte u*64 + b: low nibble at memory byte b of chunk u, high nibble of chunk u + 2 */
} block4;

typedef struct { /* Q6_K: value = d * sc[g] * (q - 32) in group g */
    float d;
    int8_t sc[16];
    uint8_t ql[128]; /* q's low four bits, packed as Q4_K's */
    uint8_t qh[64];  /* q's high two bits: bits 2t, 2t+1 of byte b for memory byte b of chunk t */
} block6;

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

/* Repack ``rows`` rows of ``nb`` raw GGUF blocks each. Returns 0, or -1 for an unknown type. */
int sp_repack(int type, const uint8_t *raw, void *out, int64_t rows, int64_t nb) {
    int64_t total = rows * nb;
    uint8_t v[QK];
    if (type == TYPE_Q4_K) {
        block4 *o = (block4 *)out;
        for (int64_t i = 0; i < total; i++) {
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
        return 0;
    }
    if (type == TYPE_Q6_K) {
        block6 *o = (block6 *)out;
        for (int64_t i = 0; i < total; i++) {
            const uint8_t *b = raw + i * 210;
            uint16_t d;
            memcpy(&d, b + 208, 2);
            o[i].d = half_to_float(d);
            memcpy(o[i].sc, b + 192, 16);
            q6k_values(b, b + 128, v);
            uint8_t low[QK];
            for (int p = 0; p < QK; p++) low[p] = v[p] & 0xF;
            pack_nibbles(low, o[i].ql);
            for (int m = 0; m < 64; m++) {
                uint8_t hb = 0;
                for (int t = 0; t < 4; t++) hb |= (uint8_t)((v[position(64 * t + m)] >> 4) << (2 * t));
                o[i].qh[m] = hb;
            }
        }
        return 0;
    }
    return -1;
}

/* Rows of repacked weights as float (an embedding lookup), by GGUF's dequantization formulas. */
int sp_dequantize_rows(int type, const void *w, int64_t nb, const int64_t *ids, int64_t n, float *y) {
    if (sp_sizeof_block(type) < 0) return -1;
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
                    int hi = (q->qh[byte % 64] >> (2 * (byte / 64))) & 3;
                    int v = (((q->ql[b] >> (4 * half)) & 0xF) | (hi << 4)) - 32;
                    out[p] = q->d * q->sc[p / 16] * v;
                }
            }
        }
    }
    return 0;
}

/* Quantize rows of x (``m`` x ``k``, row stride ``ldx``) into blocks of 256, row by row. */
void sp_quantize(const float *x, int64_t m, int64_t k, int64_t ldx, blockx *out) {
    int64_t nb = k / QK;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        for (int64_t i = 0; i < nb; i++) {
            const float *v = x + r * ldx + i * QK;
            blockx *b = out + r * nb + i;
            float amax = 0.0f;
            for (int l = 0; l < QK; l++) amax = fmaxf(amax, fabsf(v[l]));
            float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            b->d = amax / 127.0f;
            int sums[16] = {0};
            for (int byte = 0; byte < QK; byte++) {
                int p = position(byte);
                int q = (int)lrintf(v[p] * id);
                q = q > 127 ? 127 : q < -127 ? -127 : q;
                b->q[byte] = (int8_t)q;
                sums[p / 16] += q;
            }
            for (int g = 0; g < 16; g++) b->bsum[g] = b->d * (float)sums[g];
        }
    }
}

/* ---- The dot products. A block's weights are decoded once into registers and shared by a tile
 * of R rows. Each row's float work is the same sequence on every tile size (8, 4, 2 or 1, chosen
 * by how many rows are left): acc += float(S) * (sc * xd), acc -= off * bsum, lane by lane, blocks
 * in ascending order, lanes summed at the end in one fixed order. R therefore never changes a
 * row's result; the tests prove it for every M from 1 to 64. */

#define AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma"

typedef struct { /* a decoded block: weights by chunk, and each group's float scale and offset */
    __m512i w[4];
    __m512 scale, off;
} dec512;

__attribute__((target(AVX512))) static inline void decode4_512(const block4 *b, dec512 *o) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    for (int u = 0; u < 2; u++) {
        __m512i v = _mm512_loadu_si512((const void *)(b->qs + 64 * u));
        o->w[u] = _mm512_and_si512(v, m4);
        o->w[u + 2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    __m128i sc = _mm_loadl_epi64((const __m128i *)b->sc), m = _mm_loadl_epi64((const __m128i *)b->m);
    o->scale = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(sc, sc))), _mm512_set1_ps(b->d));
    o->off = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(m, m))), _mm512_set1_ps(b->dmin));
}

__attribute__((target(AVX512))) static inline void decode6_512(const block6 *b, dec512 *o) {
    const __m512i m4 = _mm512_set1_epi8(0xF), m2 = _mm512_set1_epi8(3);
    __m512i hb = _mm512_loadu_si512((const void *)b->qh);
    for (int u = 0; u < 2; u++) {
        __m512i v = _mm512_loadu_si512((const void *)(b->ql + 64 * u));
        o->w[u] = _mm512_and_si512(v, m4);
        o->w[u + 2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    o->w[0] = _mm512_or_si512(o->w[0], _mm512_slli_epi16(_mm512_and_si512(hb, m2), 4));
    o->w[1] = _mm512_or_si512(o->w[1], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 2), m2), 4));
    o->w[2] = _mm512_or_si512(o->w[2], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 4), m2), 4));
    o->w[3] = _mm512_or_si512(o->w[3], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 6), m2), 4));
    __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b->sc))),
                              _mm512_set1_ps(b->d));
    o->scale = sc;
    o->off = _mm512_mul_ps(sc, _mm512_set1_ps(32.0f));
}

#define DEFINE_TILE_512(R)                                                                         \
    __attribute__((target(AVX512))) static void tile##R##_512(int type, const uint8_t *wcol, int64_t nb, \
                                                              int64_t bsize, const blockx *x, float *y,  \
                                                              int64_t ldy) {                       \
        __m512 acc[R];                                                                             \
        for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();                                  \
        for (int64_t b = 0; b < nb; b++) {                                                         \
            dec512 d;                                                                              \
            if (type == TYPE_Q4_K) decode4_512((const block4 *)(wcol + b * bsize), &d);            \
            else decode6_512((const block6 *)(wcol + b * bsize), &d);                              \
            for (int i = 0; i < R; i++) {                                                          \
                const blockx *xb = x + i * nb + b;                                                 \
                __m512i s = _mm512_setzero_si512();                                                \
                for (int t = 0; t < 4; t++)                                                        \
                    s = _mm512_dpbusd_epi32(s, d.w[t], _mm512_loadu_si512((const void *)(xb->q + 64 * t))); \
                __m512 f = _mm512_mul_ps(d.scale, _mm512_set1_ps(xb->d));                          \
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), f, acc[i]);                        \
                acc[i] = _mm512_fnmadd_ps(d.off, _mm512_loadu_ps(xb->bsum), acc[i]);               \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < R; i++) y[i * ldy] = _mm512_reduce_add_ps(acc[i]);                     \
    }

DEFINE_TILE_512(1)
DEFINE_TILE_512(2)
DEFINE_TILE_512(4)
DEFINE_TILE_512(8)

/* AVX2 + FMA: the same layout in halves of 32 bytes (lanes of groups 0-7, then 8-15); without
 * VNNI, vpmaddubsw's pair sums (below 2 * 63 * 127, no saturation) and vpmaddwd by ones make
 * each lane's four-product sum. */
typedef struct {
    __m256i w[8]; /* chunk t, half h at 2t + h */
    __m256 scale[2], off[2];
} dec256;

__attribute__((target("avx2,fma"))) static inline void decode4_256(const block4 *b, dec256 *o) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    for (int u = 0; u < 2; u++)
        for (int h = 0; h < 2; h++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(b->qs + 64 * u + 32 * h));
            o->w[2 * u + h] = _mm256_and_si256(v, m4);
            o->w[2 * (u + 2) + h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
    __m128i sc = _mm_loadl_epi64((const __m128i *)b->sc), m = _mm_loadl_epi64((const __m128i *)b->m);
    sc = _mm_unpacklo_epi8(sc, sc);
    m = _mm_unpacklo_epi8(m, m);
    for (int h = 0; h < 2; h++) {
        o->scale[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h ? _mm_srli_si128(sc, 8) : sc)),
                                    _mm256_set1_ps(b->d));
        o->off[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h ? _mm_srli_si128(m, 8) : m)),
                                  _mm256_set1_ps(b->dmin));
    }
}

__attribute__((target("avx2,fma"))) static inline void decode6_256(const block6 *b, dec256 *o) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        __m256i hb = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
        for (int u = 0; u < 2; u++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * u + 32 * h));
            o->w[2 * u + h] = _mm256_and_si256(v, m4);
            o->w[2 * (u + 2) + h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
        for (int t = 0; t < 4; t++) {
            __m256i hi = _mm256_and_si256(t ? _mm256_srli_epi16(hb, 2 * t) : hb, m2);
            o->w[2 * t + h] = _mm256_or_si256(o->w[2 * t + h], _mm256_slli_epi16(hi, 4));
        }
        __m128i sc = _mm_loadl_epi64((const __m128i *)(b->sc + 8 * h));
        o->scale[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), _mm256_set1_ps(b->d));
        o->off[h] = _mm256_mul_ps(o->scale[h], _mm256_set1_ps(32.0f));
    }
}

__attribute__((target("avx2,fma"))) static inline float hsum8f(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define DEFINE_TILE_256(R)                                                                         \
    __attribute__((target("avx2,fma"))) static void tile##R##_256(int type, const uint8_t *wcol, int64_t nb, \
                                                                  int64_t bsize, const blockx *x, float *y,  \
                                                                  int64_t ldy) {                   \
        const __m256i ones = _mm256_set1_epi16(1);                                                 \
        __m256 acc[R][2];                                                                          \
        for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();                   \
        for (int64_t b = 0; b < nb; b++) {                                                         \
            dec256 d;                                                                              \
            if (type == TYPE_Q4_K) decode4_256((const block4 *)(wcol + b * bsize), &d);            \
            else decode6_256((const block6 *)(wcol + b * bsize), &d);                              \
            for (int i = 0; i < R; i++) {                                                          \
                const blockx *xb = x + i * nb + b;                                                 \
                __m256 xd = _mm256_set1_ps(xb->d);                                                 \
                for (int h = 0; h < 2; h++) {                                                      \
                    __m256i s = _mm256_setzero_si256();                                            \
                    for (int t = 0; t < 4; t++) {                                                  \
                        __m256i xv = _mm256_loadu_si256((const __m256i *)(xb->q + 64 * t + 32 * h)); \
                        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(d.w[2 * t + h], xv), ones)); \
                    }                                                                              \
                    __m256 f = _mm256_mul_ps(d.scale[h], xd);                                      \
                    acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), f, acc[i][h]);              \
                    acc[i][h] = _mm256_fnmadd_ps(d.off[h], _mm256_loadu_ps(xb->bsum + 8 * h), acc[i][h]); \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < R; i++) y[i * ldy] = hsum8f(_mm256_add_ps(acc[i][0], acc[i][1]));     \
    }

DEFINE_TILE_256(1)
DEFINE_TILE_256(2)
DEFINE_TILE_256(4)

#define DEFINE_GEMM(SUFFIX, TARGET, WIDEST)                                                        \
    __attribute__((target(TARGET))) static void gemm_##SUFFIX(int type, const void *w, int64_t n, int64_t k, \
                                                              const blockx *x, int64_t m, float *y, int64_t ldy) { \
        int64_t nb = k / QK, bsize = sp_sizeof_block(type);                                       \
        _Pragma("omp parallel for schedule(static)")                                              \
        for (int64_t col = 0; col < n; col++) {                                                   \
            const uint8_t *wcol = (const uint8_t *)w + col * nb * bsize;                          \
            int64_t r = 0;                                                                        \
            WIDEST                                                                                \
            for (; r + 4 <= m; r += 4) tile4_##SUFFIX(type, wcol, nb, bsize, x + r * nb, y + r * ldy + col, ldy); \
            if (r + 2 <= m) tile2_##SUFFIX(type, wcol, nb, bsize, x + r * nb, y + r * ldy + col, ldy), r += 2; \
            if (r < m) tile1_##SUFFIX(type, wcol, nb, bsize, x + r * nb, y + r * ldy + col, ldy); \
        }                                                                                         \
    }

DEFINE_GEMM(512, AVX512,
            for (; r + 8 <= m; r += 8) tile8_512(type, wcol, nb, bsize, x + r * nb, y + r * ldy + col, ldy);)
DEFINE_GEMM(256, "avx2,fma", )

/* y[:, :n] (row stride ``ldy``) = quantized rows ``x`` times the ``n`` weight rows ``w``.
 * ``isa``: 2 for AVX2 + FMA, 3 for AVX-512 with VNNI (F, BW, VL, DQ, VNNI). Returns 0, or -1 for
 * bad arguments. */
int sp_gemm(int isa, int type, const void *w, int64_t n, int64_t k, const blockx *x, int64_t m, float *y,
            int64_t ldy) {
    if (k % QK || sp_sizeof_block(type) < 0 || n < 0 || m < 0) return -1;
    if (isa == 3)
        gemm_512(type, w, n, k, x, m, y, ldy);
    else if (isa == 2)
        gemm_256(type, w, n, k, x, m, y, ldy);
    else
        return -1;
    return 0;
}
