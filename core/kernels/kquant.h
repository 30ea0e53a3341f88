/* kquant.h: SpecPlay's exact k-quant kernel, its one contract: y = x W^T for weights in GGUF's Q4_K and Q6_K blocks.
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
 *
 * The block formats and what every entry returns are here, with the entries; blocks.c repacks,
 * fits, quantizes and dequantizes blocks, gemm_x86.c multiplies them (the AVX2 and AVX-512 paths)
 * and holds sp_linear, layer.c runs a whole decoder layer through the same projection. */
#ifndef SPECPLAY_KQUANT_H
#define SPECPLAY_KQUANT_H

#include <stdint.h>

#define QK 256

enum { TYPE_Q4_K = 12, TYPE_Q6_K = 14 }; /* GGML's type numbers of the blocks the kernel multiplies */
enum { TYPE_Q5_0 = 6, TYPE_Q8_0 = 8 };   /* and of the 32-value blocks sp_fit_q4k_from fits into Q4_K */

/* What every entry returns: 0, or why it did nothing useful (its outputs are then to be thrown
 * away). Each checks its arguments before it reads or writes anything: they come from a model
 * file, and a file's numbers are a stranger's. */
enum { SP_OK = 0, SP_BAD_ARGUMENTS = -1, SP_OUT_OF_MEMORY = -2, SP_ID_OUT_OF_RANGE = -3 };

/* The largest size of any dimension: keeps every product of sizes (a scratch's bytes) inside int64. */
#define MOST_SIZE ((int64_t)1 << 24)

/* Whether ``a`` * ``b`` * ``c`` (``c`` > 0) is a count of non-negative factors that fits in int64. */
static inline int fits(int64_t a, int64_t b, int64_t c) {
    return a >= 0 && b >= 0 && (b == 0 || a <= INT64_MAX / b / c);
}

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

_Static_assert(sizeof(blockx) == 368, "blockx: 256 values, 16 + 8 sums, a scale and padding");
_Static_assert(sizeof(block4) == 152, "block4: 8 scales, 8 mins, d, dmin and 128 bytes of nibbles");
_Static_assert(sizeof(block6) == 212, "block6: 16 scales, d, 128 bytes of low bits and 64 of high bits");

/* Q6_K's high bits: chunk c (0..3) of qh, bit pair s (0..3), byte l (0..15) of the chunk belong
 * to memory byte 128h + 16t + l with h = s/2 and t = 4(c/2) + 2(c%2) + s%2, so the kernel's two
 * passes (chunks t = 0..3, then 4..7) each read the qh chunks 2z and 2z + 1 alone. */
static inline int qh_byte(int c, int s, int l) { return 128 * (s / 2) + 16 * (4 * (c / 2) + 2 * (c % 2) + s % 2) + l; }

typedef struct { /* one (fused) projection: up to three k-quant matrices side by side, and a bias */
    int32_t parts;
    int32_t types[3];
    const void *ws[3];
    int64_t ns[3];
    int64_t k, width, out; /* stored inputs (a multiple of 256), real inputs, outputs */
    const float *bias;     /* or NULL */
} sp_linear_t;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps;
    int32_t unused;
    const float *ln_in, *ln_post;
    sp_linear_t qkv, o, gate_up, down;
} sp_layer_t;

/* ---- The entries. Each returns a status and checks its arguments before it reads or writes. */

int sp_sizeof_blockx(void);
int sp_sizeof_block(int type); /* -1 for a type the kernel does not read */
int sp_repack(int type, const uint8_t *raw, void *out, int64_t rows, int64_t nb);
int sp_quantize_q4k(const float *w, int64_t rows, int64_t k, int64_t ldw, block4 *out);
int sp_fit_q4k_from(int type, const uint8_t *raw, int64_t rows, int64_t width, int64_t k, block4 *out);
int sp_dequantize_rows(int type, const void *w, int64_t rows, int64_t nb, const int64_t *ids, int64_t n, float *y);
int sp_linear(int isa, const sp_linear_t *l, const float *x, int64_t m, int64_t ldx, blockx *xq, float *y,
              int64_t ldy);
int64_t sp_layers_scratch(const sp_layer_t *Ls, int64_t n, int64_t m);
int sp_layers(int isa, const sp_layer_t *Ls, int64_t n, float *x, int64_t m, const float *cos, const float *sin,
              float *const *kvs, int64_t cap, int64_t base, const uint8_t *mask, int causal, void *scratch);

/* ---- Inside a parallel region (they share their work among its threads; unchecked: their callers
 * check). */

void sp_quantize_rows(const float *x, int64_t m, int64_t k, int64_t width, int64_t ldx, blockx *out);
void sp_gemm_rows(int isa, int type, const void *w, int64_t n, int64_t k, const blockx *x, int64_t m, float *y,
                  int64_t ldy);
void sp_project(int isa, const sp_linear_t *l, const float *x, int64_t m, int64_t ldx, blockx *xq, float *y,
                int64_t ldy);
/* Whether a projection's own sizes disagree (no parts or more than three, inputs not whole blocks
 * of QK or past them, an unknown block type, rows that are negative, missing or do not add up to
 * ``out``). */
int sp_bad_linear(const sp_linear_t *l);

#endif
