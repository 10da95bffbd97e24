/* Mixed precision on the CPU: values that the graph keeps (saved activations
 * and activation gradients) are stored with the precision of the compute
 * dtype, arithmetic stays fp32.
 *
 * op_round_to_dtype rounds an fp32 buffer in place to the nearest value the
 * dtype can hold, exactly as a store to fp16/bf16 and a load back would:
 *  - f16 (F16C, round to nearest even): |x| >= 65520 becomes +-inf, as a real
 *    fp16 store saturates, so a too-large loss scale produces inf gradients
 *    that the loss scaler sees; tiny values flush to fp16 subnormals / zero.
 *  - bf16: round to nearest even on the top 16 bits; NaN stays NaN.
 *  - f32: nothing. */
#ifndef QT_BACKEND_CPU_OP_PRECISION_H
#define QT_BACKEND_CPU_OP_PRECISION_H

#include <stddef.h>
#include <stdint.h>

#include "core/dtype.h"

/* x (n) in place; OpenMP-parallel for large n. */
void op_round_to_dtype(float *x, size_t n, qt_dtype dt);

/* Storing what the graph keeps in 2 bytes (f16/bf16 training): x (n) is
 * rounded in place exactly as op_round_to_dtype does, and the same values'
 * 2-byte bit patterns are written to dst (n) in that pass. dt is QT_F16 or
 * QT_BF16. */
void op_round_store(float *x, uint16_t *dst, size_t n, qt_dtype dt);

/* dst (n, ddt) = src (n, sdt), through f32 in blocks (f16 <-> bf16 included;
 * values beyond fp16's range become inf); OpenMP-parallel for large n. From
 * f16/bf16 to f32 it is exact: the inverse of op_round_store. */
void op_convert(void *dst, qt_dtype ddt, const void *src, qt_dtype sdt, size_t n);

/* 1 when the CPU executes bf16 dot products natively (AVX512_BF16). */
int op_cpu_has_bf16(void);

#endif
