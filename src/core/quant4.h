/* 4-bit weights as bitsandbytes stores them (QLoRA): NF4 or FP4 codes packed
 * two a byte (the first value in the high nibble), one float32 absmax per
 * block of 64 values of the flattened (row-major) weight, and optionally the
 * absmax values themselves quantized ("double quantization"): minus their
 * mean (the offset), 8-bit against the signed dynamic map in blocks of 256,
 * each of those blocks with a float32 absmax of its own.
 *
 * The arithmetic is bitsandbytes' CUDA kernels' (csrc/kernels.cu
 * kQuantizeBlockwise, kDequantizeBlockwise, dQuantizeNF4, dQuantizeFP4,
 * dQuantize), step for step in float32: absmax = max |x| of the block, the
 * values multiplied by the float32 reciprocal 1 / absmax, the 4-bit code
 * chosen by the kernel's tree of thresholds (a value on a threshold takes the
 * lower code), the 8-bit code by the kernel's binary search and midpoint.
 * One step is qtune's own: the offset is the mean summed in double and rounded
 * once (torch's float32 mean depends on the device's reduction order). The
 * tests hold this file bit for bit against tests/quant/bnb_ref.py, a
 * reference written from the published algorithm.
 *
 * Dequantization: value = code[q] * absmax (float32), then rounded to the
 * dtype the weight was quantized from (bitsandbytes' quant_state.dtype), as
 * dequantize_4bit returns it. */
#ifndef QT_CORE_QUANT4_H
#define QT_CORE_QUANT4_H

#include <stddef.h>
#include <stdint.h>

#include "core/dtype.h"

typedef enum { QT_Q4_NF4 = 0, QT_Q4_FP4 = 1 } qt_q4_type;

#define QT_Q4_BLOCK 64   /* values per absmax (bnb_4bit blocksize; the only one qtune writes) */
#define QT_Q4_BLOCK2 256 /* absmax values per nested absmax (double quantization) */

extern const float qt_q4_nf4_code[16];   /* get_4bit_type("nf4") */
extern const float qt_q4_fp4_code[16];   /* get_4bit_type("fp4"): bit-pattern order, divided by 12 */
const float *qt_q8_dynamic_map(void); /* create_dynamic_map(signed=True): 256 floats, sorted */

const char *qt_q4_type_name(qt_q4_type t); /* "nf4" "fp4" */

/* The 4-bit code of one normalised value x (x * (1 / absmax)). */
uint8_t qt_q4_code_of(qt_q4_type t, float x);
/* The 8-bit code of one normalised value against a sorted 256-entry map. */
uint8_t qt_q8_code_of(const float code[256], float x);

/* x (n, f32) -> packed ((n + 1) / 2 bytes) and absmax (ceil(n / blocksize)). */
void qt_q4_quantize(qt_q4_type t, const float *x, size_t n, int blocksize, uint8_t *packed, float *absmax);
/* x (n) -> q (n) and absmax (ceil(n / blocksize)), 8-bit blockwise. */
void qt_q8_quantize(const float code[256], const float *x, size_t n, int blocksize, uint8_t *q, float *absmax);
/* The offset of double quantization: the mean of absmax (nb values). */
float qt_q4_absmax_offset(const float *absmax, size_t nb);

/* A 4-bit weight as the backends read it: the (pointer, QT_Q4) pair of a
 * matmul points at this header, which is followed in the same allocation by
 * the packed codes, then the absmax values (nb f32; or, nested, nb u8 and then
 * nb2 f32). Offsets count bytes from the header, so the block moves to a
 * device as one copy. */
typedef struct {
    uint32_t magic;      /* QT_Q4_MAGIC */
    uint32_t type;       /* qt_q4_type */
    uint32_t dtype;      /* qt_dtype the dequantized values round to (quant_state.dtype) */
    uint32_t blocksize;  /* values per absmax */
    uint32_t nested;     /* 1: absmax is 8-bit (double quantization) */
    uint32_t blocksize2; /* absmax values per nested absmax */
    uint64_t rows, cols; /* the weight's shape (OUT, IN) */
    uint64_t nb, nb2;    /* absmax values, nested absmax values */
    int64_t packed_off, absmax_off, absmax2_off; /* bytes from this header (a view's point into another block) */
    uint64_t bytes;      /* of the whole block (a view: of its header) */
    uint64_t e0;         /* a view: its first value's index in the data it points into; else 0 */
    float offset;        /* nested: added to every dequantized absmax */
    float code[16];      /* quant_map */
    float code2[256];    /* nested_quant_map */
} qt_q4_weight;
#define QT_Q4_MAGIC 0x34714e51u /* "QNq4" */

/* Bytes of the whole block for a (rows, cols) weight. */
size_t qt_q4_bytes(uint64_t rows, uint64_t cols, int blocksize, int nested);
/* Fills the header of a block of qt_q4_bytes (offsets, tables) for a weight
 * about to be quantized or read; the data parts are left to the caller. */
void qt_q4_init(qt_q4_weight *w, qt_q4_type t, qt_dtype dtype, uint64_t rows, uint64_t cols, int blocksize,
                int nested);
/* A (rows, cols) view of rows [row0, row0 + rows) of w, in a header of its
 * own (the fused q/k/v of the original Qwen: k and v are row slices of one
 * quantized c_attn). w is a copy of the header that lives at w_at, the view
 * will live at view_at (device addresses); its offsets point from there
 * into w's data. */
void qt_q4_view(const qt_q4_weight *w, const void *w_at, const void *view_at, uint64_t row0, uint64_t rows,
                qt_q4_weight *view);
static inline uint8_t *qt_q4_packed(const qt_q4_weight *w) { return (uint8_t *)w + w->packed_off; }
static inline void *qt_q4_absmax(const qt_q4_weight *w) { return (uint8_t *)w + w->absmax_off; }
static inline float *qt_q4_absmax2(const qt_q4_weight *w) { return (float *)((uint8_t *)w + w->absmax2_off); }

/* Quantizes x (rows * cols values in sdt) into w (qt_q4_init'ed): QT_OK, or
 * QT_ENOMEM (nested: the float32 absmax of the whole weight is held while its
 * mean is taken). */
int qt_q4_quantize_weight(qt_q4_weight *w, const void *x, qt_dtype sdt);
/* The float32 absmax of block b (nested: code2[q] * absmax2 + offset). */
float qt_q4_block_absmax(const qt_q4_weight *w, size_t b);
/* The float32 absmax of blocks [b0, b0 + n): a pointer to the stored ones,
 * or (nested) out filled with qt_q4_block_absmax's values. */
const float *qt_q4_absmax_run(const qt_q4_weight *w, size_t b0, size_t n, float *out);
/* Values [e0, e1) of the flattened weight (a view's own numbering), dequantized and rounded to
 * w->dtype, as f32 into out. AVX-512 or AVX2 where compiled in. */
void qt_q4_dequantize(const qt_q4_weight *w, size_t e0, size_t e1, float *out);
/* The SIMD path of qt_q4_dequantize and of the CPU's fused 4-bit matvec
 * (tests force the others): 0 scalar, 1 AVX2, 2 AVX-512 (capped at what is
 * compiled in); set returns the previous level. */
int qt_q4_set_simd(int level);
int qt_q4_simd(void);
/* Checks a header against the bytes it claims: QT_OK, or QT_EINVAL naming
 * what is wrong (what: the tensor, for the message). */
int qt_q4_check(const qt_q4_weight *w, size_t bytes, const char *what);

#endif
