/* The CUDA backend's descriptor: plain facts that hold without a GPU or the
 * module present, so `qtune plan --device cuda` answers on any machine. */
#include "backend/cuda/backend_cuda.h"

/* Facts the memory plan reads:
 *  - 256-byte alignment, what cudaMalloc gives and cuBLAS likes;
 *  - bf16 and f16 GEMM operands run natively on the tensor cores;
 *  - an lm_head chunk of 8192 vocabulary rows: logits (N, 8192) in fp32 per
 *    chunk, few enough launches for a 152k vocabulary;
 *  - a matmul may convert its whole weight to fp32 in the workspace (a frozen
 *    bf16 base read by the fp32 reference path): no cap;
 *  - the CUDA context, cuBLAS's workspace and handles: about 600 MiB of
 *    device memory on current drivers, a lead to be measured on the first
 *    GPU run (docs/backends.md); the open backend reports what it measured. */
static const qt_backend_desc cuda_desc = {
    .name = "cuda",
    .alignment = 256,
    .native_dtypes = QT_BE_DT(QT_F32) | QT_BE_DT(QT_BF16) | QT_BE_DT(QT_F16),
    .ce_chunk = 8192,
    .matmul_ws_cap = (size_t)-1 / 8,
    .runtime_bytes = (size_t)600 << 20,
    .runtime_extra = 0,
    .host_reads_device = 0,
};

const qt_backend_desc *qt_backend_cuda_desc(void) { return &cuda_desc; }
