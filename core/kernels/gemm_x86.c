/* The k-quant kernel's products (kquant.h) on x86: the AVX-512 VNNI and AVX2 paths, chosen by the
 * caller, giving the same bits, and sp_linear, the one projection entry (the decoder layer runs the
 * same projection inside its own parallel region: layer.c). */
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#include "kquant.h"

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

int sp_bad_linear(const sp_linear_t *l) {
    if (l->parts < 1 || l->parts > 3 || l->k < QK || l->k % QK || l->width < 1 || l->width > l->k || l->out < 0)
        return 1;
    int64_t rows = 0;
    for (int i = 0; i < l->parts; i++) {
        if (sp_sizeof_block(l->types[i]) < 0 || l->ns[i] < 0 || l->ns[i] > l->out - rows || (l->ns[i] && !l->ws[i]))
            return 1;
        rows += l->ns[i];
    }
    return rows != l->out;
}

/* Rows ``x`` (``m`` x ``l->width``, stride ``ldx``) quantized into ``xq`` (``m`` x ``l->k / 256``
 * blocks, zeros past the width), multiplied by the projection's matrices, their outputs side by
 * side in ``y`` (row stride ``ldy``), the bias added last. */
void sp_project(int isa, const sp_linear_t *l, const float *x, int64_t m, int64_t ldx, blockx *xq, float *y,
                int64_t ldy) {
    sp_quantize_rows(x, m, l->k, l->width, ldx, xq);
    int64_t col = 0;
    for (int i = 0; i < l->parts; col += l->ns[i], i++)
        sp_gemm_rows(isa, l->types[i], l->ws[i], l->ns[i], l->k, xq, m, y + col, ldy);
    if (l->bias) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < l->out; j++) y[r * ldy + j] += l->bias[j];
    }
}

/* One projection (sp_project) in one parallel region: each region costs a wake-up of the threads,
 * a third of a small draft layer's time were it one a step. Returns a status. */
int sp_linear(int isa, const sp_linear_t *l, const float *x, int64_t m, int64_t ldx, blockx *xq, float *y,
              int64_t ldy) {
    if ((isa != 2 && isa != 3) || !l || sp_bad_linear(l) || ldx < l->width || !fits(m, ldx, sizeof(float)) ||
        !fits(m, l->k, sizeof(blockx)) || ldy < l->out || !fits(m, ldy, sizeof(float)) || (m && (!x || !xq || !y)))
        return SP_BAD_ARGUMENTS;
#pragma omp parallel
    sp_project(isa, l, x, m, ldx, xq, y, ldy);
    return SP_OK;
}
