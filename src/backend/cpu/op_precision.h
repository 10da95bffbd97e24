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

#include "core/dtype.h"

/* x (n) in place; OpenMP-parallel for large n. */
void op_round_to_dtype(float *x, size_t n, qt_dtype dt);

/* 1 when the CPU executes bf16 dot products natively (AVX512_BF16). */
int op_cpu_has_bf16(void);

#endif
