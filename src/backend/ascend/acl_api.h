/* The part of Huawei CANN's API the Ascend backend calls: AscendCL's runtime
 * (libascendcl.so), the aclnn tensor objects (libnnopbase.so) and the aclnn
 * operators (libopapi.so), declared here and nowhere else. qtune is built
 * without CANN: the backend opens the libraries with dlopen on first use
 * (ascend_loader.c) and finds every function below by name; the tests load
 * a CPU stand-in of the same functions instead (tests/unit/backend_parity/
 * acl_standin.c, through $QTUNE_ASCEND_LIB).
 *
 * Every value and prototype is copied from CANN's published headers, never
 * guessed; the source of each table is named beside it. "8.1.RC1" is the
 * CANN 8.1.RC1 toolkit's headers (Ascend/ascend-toolkit/8.1.RC1/...), as the
 * public repository leideng/CANN-8.1.RC1 carries them; "runtime" is the
 * open-sourced CANN runtime's include/external/acl/ (repository
 * hicann/runtime, commit 681ef76, 2026-08-22), which gives the same values.
 * Operators CANN has that the backend does not call yet are left out; those
 * the backend needs but whose facts were not found are listed at the end. */
#ifndef QT_BACKEND_ASCEND_ACL_API_H
#define QT_BACKEND_ASCEND_ACL_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- handles and status types --------------------------------------------
 * 8.1.RC1 include/acl/acl_base.h (runtime: acl_base_rt.h): aclrtStream,
 * aclrtEvent are void *; aclError is int. 8.1.RC1 include/aclnn/acl_meta.h:
 * the opaque aclTensor, aclScalar, aclOpExecutor, and aclnnStatus int32_t. */
typedef void *aclrtStream;
typedef void *aclrtEvent;
typedef int aclError;
typedef int32_t aclnnStatus;
typedef struct aclOpExecutor aclOpExecutor;
typedef struct aclTensor aclTensor;
typedef struct aclScalar aclScalar;
typedef struct aclIntArray aclIntArray;

/* ---- aclError codes: 8.1.RC1 include/acl/acl_base.h ---------------------- */
#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_UNINITIALIZE 100001
#define ACL_ERROR_REPEAT_INITIALIZE 100002
#define ACL_ERROR_UNSUPPORTED_DATA_TYPE 100026
#define ACL_ERROR_FORMAT_NOT_MATCH 100027
#define ACL_ERROR_BAD_ALLOC 200000
#define ACL_ERROR_INVALID_DEVICE 200002
#define ACL_ERROR_FEATURE_UNSUPPORTED 200006
/* include/acl/error_codes/rt_error_codes.h (runtime) */
#define ACL_ERROR_RT_PARAM_INVALID 107000
#define ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000
#define ACL_ERROR_RT_MEMORY_ALLOCATION 207001

/* ---- aclnnStatus codes: 8.1.RC1 include/aclnn/opdev/op_errno.h ----------- */
#define ACLNN_SUCCESS 0
#define ACLNN_ERR_PARAM_NULLPTR 161001
#define ACLNN_ERR_PARAM_INVALID 161002
#define ACLNN_ERR_RUNTIME_ERROR 361001
#define ACLNN_ERR_INNER 561000

/* ---- aclDataType: 8.1.RC1 include/acl/acl_base.h (the values used) ------- */
typedef enum {
    ACL_DT_UNDEFINED = -1,
    ACL_FLOAT = 0,
    ACL_FLOAT16 = 1,
    ACL_INT8 = 2,
    ACL_INT32 = 3,
    ACL_UINT8 = 4,
    ACL_INT64 = 9,
    ACL_DOUBLE = 11,
    ACL_BOOL = 12,
    ACL_BF16 = 27,
} aclDataType;

/* ---- aclFormat: 8.1.RC1 include/acl/acl_base.h (the values used) --------- */
typedef enum {
    ACL_FORMAT_UNDEFINED = -1,
    ACL_FORMAT_NCHW = 0,
    ACL_FORMAT_NHWC = 1,
    ACL_FORMAT_ND = 2,
    ACL_FORMAT_FRACTAL_NZ = 29,
} aclFormat;

/* ---- aclrtMemcpyKind, in order from 0: 8.1.RC1 include/acl/acl_rt.h ------ */
typedef enum {
    ACL_MEMCPY_HOST_TO_HOST = 0,
    ACL_MEMCPY_HOST_TO_DEVICE = 1,
    ACL_MEMCPY_DEVICE_TO_HOST = 2,
    ACL_MEMCPY_DEVICE_TO_DEVICE = 3,
} aclrtMemcpyKind;

/* ---- aclrtMemMallocPolicy, in order from 0: 8.1.RC1 include/acl/acl_rt.h - */
typedef enum {
    ACL_MEM_MALLOC_HUGE_FIRST = 0,
    ACL_MEM_MALLOC_HUGE_ONLY = 1,
    ACL_MEM_MALLOC_NORMAL_ONLY = 2,
} aclrtMemMallocPolicy;

/* ---- aclrtMemAttr, in order from 0: runtime include/external/acl/acl_rt.h  */
typedef enum {
    ACL_DDR_MEM = 0,
    ACL_HBM_MEM = 1,
} aclrtMemAttr;

/* ---- cubeMathType of the matmul operators --------------------------------
 * aclnnMatmul's documentation (cann-ops src/matmul/mat_mul_v3/doc/
 * aclnnMatmul.md): 0 KEEP_DTYPE (not for FLOAT32 inputs on Ascend 910 and
 * 310P), 1 ALLOW_FP32_DOWN_PRECISION (FLOAT32 computed as FLOAT16 on 910 and
 * 310P, as HFLOAT32 on 910B), 2 USE_FP16, 3 USE_HF32. */
#define QT_ACL_CUBE_KEEP_DTYPE 0
#define QT_ACL_CUBE_ALLOW_FP32_DOWN_PRECISION 1

/* ---- the functions, X(return type, name, parameters) per library ---------
 * libascendcl.so, 8.1.RC1 include/acl/acl.h (aclInit, aclFinalize),
 * include/acl/acl_base.h (aclrtGetSocName) and include/acl/acl_rt.h. */
#define QT_ACL_RT_FUNCS(X)                                                                                       \
    X(aclError, aclInit, (const char *configPath))                                                               \
    X(aclError, aclFinalize, (void))                                                                             \
    X(const char *, aclrtGetSocName, (void))                                                                     \
    X(aclError, aclrtGetDeviceCount, (uint32_t * count))                                                         \
    X(aclError, aclrtSetDevice, (int32_t deviceId))                                                              \
    X(aclError, aclrtResetDevice, (int32_t deviceId))                                                            \
    X(aclError, aclrtCreateStream, (aclrtStream * stream))                                                       \
    X(aclError, aclrtDestroyStream, (aclrtStream stream))                                                        \
    X(aclError, aclrtSynchronizeStream, (aclrtStream stream))                                                    \
    X(aclError, aclrtMalloc, (void **devPtr, size_t size, aclrtMemMallocPolicy policy))                          \
    X(aclError, aclrtFree, (void *devPtr))                                                                       \
    X(aclError, aclrtMallocHost, (void **hostPtr, size_t size))                                                  \
    X(aclError, aclrtFreeHost, (void *hostPtr))                                                                  \
    X(aclError, aclrtMemcpy, (void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind))   \
    X(aclError, aclrtMemcpyAsync,                                                                                \
      (void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind, aclrtStream stream))      \
    X(aclError, aclrtMemsetAsync, (void *devPtr, size_t maxCount, int32_t value, size_t count, aclrtStream stream)) \
    X(aclError, aclrtCreateEvent, (aclrtEvent * event))                                                          \
    X(aclError, aclrtRecordEvent, (aclrtEvent event, aclrtStream stream))                                        \
    X(aclError, aclrtSynchronizeEvent, (aclrtEvent event))                                                       \
    X(aclError, aclrtDestroyEvent, (aclrtEvent event))                                                           \
    X(aclError, aclrtGetMemInfo, (aclrtMemAttr attr, size_t *free, size_t *total))

/* libnnopbase.so, 8.1.RC1 include/aclnn/acl_meta.h. */
#define QT_ACL_META_FUNCS(X)                                                                                     \
    X(aclTensor *, aclCreateTensor,                                                                              \
      (const int64_t *viewDims, uint64_t viewDimsNum, aclDataType dataType, const int64_t *stride, int64_t offset, \
       aclFormat format, const int64_t *storageDims, uint64_t storageDimsNum, void *tensorData))                 \
    X(aclnnStatus, aclDestroyTensor, (const aclTensor *tensor))                                                  \
    X(aclScalar *, aclCreateScalar, (void *value, aclDataType dataType))                                         \
    X(aclnnStatus, aclDestroyScalar, (const aclScalar *scalar))                                                  \
    X(aclIntArray *, aclCreateIntArray, (const int64_t *value, uint64_t size))                                   \
    X(aclnnStatus, aclDestroyIntArray, (const aclIntArray *array))

/* libopapi.so, 8.1.RC1 opp/built-in/op_impl/ai_core/tbe/op_api/include/
 * aclnnop/: aclnn_addmm.h, aclnn_add.h, aclnn_cast.h, aclnn_rms_norm.h,
 * aclnn_rms_norm_grad.h, aclnn_copy.h, aclnn_mul.h, aclnn_swi_glu.h,
 * aclnn_swi_glu_grad.h, aclnn_embedding.h, aclnn_sub.h, aclnn_addcmul.h,
 * aclnn_addcdiv.h, aclnn_sqrt.h, aclnn_div.h. Each operator is two calls: *GetWorkspaceSize
 * checks the arguments and returns the device workspace it needs and an
 * executor; the second runs that executor on a stream (and consumes it). */
#define QT_ACL_OP_FUNCS(X)                                                                                       \
    X(aclnnStatus, aclnnInplaceAddmmGetWorkspaceSize,                                                            \
      (const aclTensor *selfRef, const aclTensor *mat1, const aclTensor *mat2, const aclScalar *beta,            \
       const aclScalar *alpha, int8_t cubeMathType, uint64_t *workspaceSize, aclOpExecutor **executor))         \
    X(aclnnStatus, aclnnInplaceAddmm,                                                                            \
      (void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, const aclrtStream stream))              \
    X(aclnnStatus, aclnnInplaceAddGetWorkspaceSize,                                                              \
      (const aclTensor *selfRef, const aclTensor *other, const aclScalar *alpha, uint64_t *workspaceSize,        \
       aclOpExecutor **executor))                                                                                \
    X(aclnnStatus, aclnnInplaceAdd, (void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream)) \
    X(aclnnStatus, aclnnCastGetWorkspaceSize,                                                                    \
      (const aclTensor *self, const aclDataType dtype, aclTensor *out, uint64_t *workspaceSize,                  \
       aclOpExecutor **executor))                                                                                \
    X(aclnnStatus, aclnnCast, (void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream)) \
    X(aclnnStatus, aclnnRmsNormGetWorkspaceSize,                                                                 \
      (const aclTensor *x, const aclTensor *gamma, double epsilon, const aclTensor *yOut, const aclTensor *rstdOut, \
       uint64_t *workspaceSize, aclOpExecutor **executor))                                                       \
    X(aclnnStatus, aclnnRmsNorm, (void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream)) \
    X(aclnnStatus, aclnnRmsNormGradGetWorkspaceSize,                                                             \
      (const aclTensor *dy, const aclTensor *x, const aclTensor *rstd, const aclTensor *gamma,                   \
       const aclTensor *dxOut, const aclTensor *dgammaOut, uint64_t *workspaceSize, aclOpExecutor **executor))   \
    X(aclnnStatus, aclnnRmsNormGrad,                                                                             \
      (void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream))                    \
    X(aclnnStatus, aclnnInplaceCopyGetWorkspaceSize,                                                             \
      (aclTensor *selfRef, const aclTensor *src, uint64_t *workspaceSize, aclOpExecutor **executor))             \
    X(aclnnStatus, aclnnInplaceCopy,                                                                             \
      (void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, const aclrtStream stream))              \
    X(aclnnStatus, aclnnInplaceMulsGetWorkspaceSize,                                                             \
      (aclTensor *selfRef, const aclScalar *other, uint64_t *workspaceSize, aclOpExecutor **executor))           \
    X(aclnnStatus, aclnnInplaceMuls, (void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream)) \
    X(aclnnStatus, aclnnSwiGluGetWorkspaceSize,                                                                  \
      (const aclTensor *x, int64_t dim, const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor)) \
    X(aclnnStatus, aclnnSwiGlu, (void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream)) \
    X(aclnnStatus, aclnnSwiGluGradGetWorkspaceSize,                                                              \
      (const aclTensor *yGrad, const aclTensor *x, int64_t dim, const aclTensor *out, uint64_t *workspaceSize,   \
       aclOpExecutor **executor))                                                                                \
    X(aclnnStatus, aclnnSwiGluGrad, (void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream)) \
    X(aclnnStatus, aclnnEmbeddingGetWorkspaceSize,                                                               \
      (const aclTensor *weight, const aclTensor *indices, const aclTensor *out, uint64_t *workspaceSize,         \
       aclOpExecutor **executor))                                                                                \
    X(aclnnStatus, aclnnEmbedding,                                                                               \
      (void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, const aclrtStream stream))              \
    QT_ACL_ELEMENTWISE_FUNCS(X)                                                                                  \
    QT_ACL_ATTENTION_FUNCS(X)                                                                                    \
    QT_ACL_REDUCE_FUNCS(X)

/* Fused attention, 8.1.RC1 aclnnop/aclnn_flash_attention_score.h and
 * aclnn_flash_attention_score_grad.h; the semantics (layouts BSH / SBH / BSND
 * / BNSD, GQA as Nq a multiple of Nkv, softmaxMax / softmaxSum (B, N, Sq, 8)
 * FLOAT, attenMask 1 = masked, sparseMode 0 defaultMask, 1 allMask, 2
 * leftUpCausal and 3 rightDownCausal with the compressed (2048, 2048) lower-
 * triangular mask; "Atlas A2 training series" only) from CANN's operator
 * documents FlashAttentionScore.md, FlashAttentionScoreGrad.md and
 * common/sparse_mode参数说明.md (repository cann-ops-adv, as
 * yueliang13/cann-ops-adv-vllm carries it, commit 015e205). */
#define QT_ACL_ATTENTION_FUNCS(X)                                                                                \
    X(aclnnStatus, aclnnFlashAttentionScoreGetWorkspaceSize,                                                     \
      (const aclTensor *query, const aclTensor *key, const aclTensor *value, const aclTensor *realShiftOptional, \
       const aclTensor *dropMaskOptional, const aclTensor *paddingMaskOptional, const aclTensor *attenMaskOptional, \
       const aclIntArray *prefixOptional, double scaleValue, double keepProb, int64_t preTokens, int64_t nextTokens, \
       int64_t headNum, char *inputLayout, int64_t innerPrecise, int64_t sparseMode, const aclTensor *softmaxMaxOut, \
       const aclTensor *softmaxSumOut, const aclTensor *softmaxOutOut, const aclTensor *attentionOutOut,          \
       uint64_t *workspaceSize, aclOpExecutor **executor))                                                       \
    X(aclnnStatus, aclnnFlashAttentionScore,                                                                     \
      (void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, const aclrtStream stream))              \
    X(aclnnStatus, aclnnFlashAttentionScoreGradGetWorkspaceSize,                                                 \
      (const aclTensor *query, const aclTensor *keyIn, const aclTensor *value, const aclTensor *dy,              \
       const aclTensor *pseShiftOptional, const aclTensor *dropMaskOptional, const aclTensor *paddingMaskOptional, \
       const aclTensor *attenMaskOptional, const aclTensor *softmaxMaxOptional, const aclTensor *softmaxSumOptional, \
       const aclTensor *softmaxInOptional, const aclTensor *attentionInOptional, const aclIntArray *prefixOptional, \
       double scaleValue, double keepProb, int64_t preTokens, int64_t nextTokens, int64_t headNum, char *inputLayout, \
       int64_t innerPrecise, int64_t sparseMode, const aclTensor *dqOut, const aclTensor *dkOut,                  \
       const aclTensor *dvOut, const aclTensor *dpseOut, uint64_t *workspaceSize, aclOpExecutor **executor))    \
    X(aclnnStatus, aclnnFlashAttentionScoreGrad,                                                                 \
      (void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, const aclrtStream stream))

/* The cross-entropy's and the embedding backward's pieces: 8.1.RC1
 * aclnnop/aclnn_log.h, aclnn_exp.h, aclnn_logsumexp.h (self, dim as an
 * aclIntArray, keepDim, out), aclnn_index_add.h (out = self with source's
 * rows added at index along dim; index INT32 / INT64, 0-1 dimensions:
 * hicann/ops-nn index/inplace_scatter_add/docs/aclnnIndexAdd.md, which also
 * says it is non-deterministic unless determinism is set with
 * aclrtCtxSetSysParamOpt). */
#define QT_ACL_REDUCE_FUNCS(X)                                                                                   \
    X(aclnnStatus, aclnnLogGetWorkspaceSize,                                                                     \
      (const aclTensor *self, aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor))                \
    X(aclnnStatus, aclnnLog, (void *workspace, uint64_t workspace_size, aclOpExecutor *executor, aclrtStream stream)) \
    X(aclnnStatus, aclnnInplaceExpGetWorkspaceSize,                                                              \
      (aclTensor * selfRef, uint64_t *workspaceSize, aclOpExecutor **executor))                                  \
    X(aclnnStatus, aclnnInplaceExp, QT_ACL_LAUNCH_PARAMS)                                                        \
    X(aclnnStatus, aclnnLogSumExpGetWorkspaceSize,                                                               \
      (const aclTensor *self, const aclIntArray *dim, bool keepDim, aclTensor *out, uint64_t *workspaceSize,     \
       aclOpExecutor **executor))                                                                                \
    X(aclnnStatus, aclnnLogSumExp, QT_ACL_LAUNCH_PARAMS)                                                         \
    X(aclnnStatus, aclnnIndexAddGetWorkspaceSize,                                                                \
      (const aclTensor *self, const int64_t dim, const aclTensor *index, const aclTensor *source,                \
       const aclScalar *alpha, aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor))               \
    X(aclnnStatus, aclnnIndexAdd, QT_ACL_LAUNCH_PARAMS)

/* The elementwise operators AdamW and RoPE are built from (aclnn_mul.h, aclnn_add.h,
 * aclnn_sub.h, aclnn_addcmul.h, aclnn_addcdiv.h, aclnn_sqrt.h, aclnn_div.h). */
#define QT_ACL_LAUNCH_PARAMS (void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream)
#define QT_ACL_ELEMENTWISE_FUNCS(X)                                                                              \
    X(aclnnStatus, aclnnMulsGetWorkspaceSize,                                                                    \
      (const aclTensor *self, const aclScalar *other, aclTensor *out, uint64_t *workspaceSize,                   \
       aclOpExecutor **executor))                                                                                \
    X(aclnnStatus, aclnnMuls, QT_ACL_LAUNCH_PARAMS)                                                              \
    X(aclnnStatus, aclnnMulGetWorkspaceSize,                                                                     \
      (const aclTensor *self, const aclTensor *other, aclTensor *out, uint64_t *workspaceSize,                   \
       aclOpExecutor **executor))                                                                                \
    X(aclnnStatus, aclnnMul, QT_ACL_LAUNCH_PARAMS)                                                               \
    X(aclnnStatus, aclnnSubGetWorkspaceSize,                                                                     \
      (const aclTensor *self, const aclTensor *other, const aclScalar *alpha, aclTensor *out,                    \
       uint64_t *workspaceSize, aclOpExecutor **executor))                                                       \
    X(aclnnStatus, aclnnSub, QT_ACL_LAUNCH_PARAMS)                                                               \
    X(aclnnStatus, aclnnInplaceAddsGetWorkspaceSize,                                                             \
      (const aclTensor *selfRef, const aclScalar *other, const aclScalar *alpha, uint64_t *workspaceSize,        \
       aclOpExecutor **executor))                                                                                \
    X(aclnnStatus, aclnnInplaceAdds, QT_ACL_LAUNCH_PARAMS)                                                       \
    X(aclnnStatus, aclnnInplaceAddcmulGetWorkspaceSize,                                                          \
      (const aclTensor *selfRef, const aclTensor *tensor1, const aclTensor *tensor2, const aclScalar *value,     \
       uint64_t *workspaceSize, aclOpExecutor **executor))                                                       \
    X(aclnnStatus, aclnnInplaceAddcmul, QT_ACL_LAUNCH_PARAMS)                                                    \
    X(aclnnStatus, aclnnInplaceAddcdivGetWorkspaceSize,                                                          \
      (const aclTensor *selfRef, const aclTensor *tensor1, const aclTensor *tensor2, const aclScalar *value,     \
       uint64_t *workspaceSize, aclOpExecutor **executor))                                                       \
    X(aclnnStatus, aclnnInplaceAddcdiv,                                                                          \
      (void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, const aclrtStream stream))              \
    X(aclnnStatus, aclnnSqrtGetWorkspaceSize,                                                                    \
      (const aclTensor *self, aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **opExecutor))              \
    X(aclnnStatus, aclnnSqrt,                                                                                    \
      (void *workspace, uint64_t workspaceSize, aclOpExecutor *opExecutor, aclrtStream stream))                  \
    X(aclnnStatus, aclnnInplaceDivsGetWorkspaceSize,                                                             \
      (aclTensor *selfRef, const aclScalar *other, uint64_t *workspaceSize, aclOpExecutor **executor))           \
    X(aclnnStatus, aclnnInplaceDivs, QT_ACL_LAUNCH_PARAMS)

/* Every function the backend calls, in one list (the loader's table). */
#define QT_ACL_FUNCS(X) QT_ACL_RT_FUNCS(X) QT_ACL_META_FUNCS(X) QT_ACL_OP_FUNCS(X)

/* The prototypes themselves, for the stand-in that defines them. */
#define QT_ACL_PROTO(ret, name, params) ret name params;

/* Not declared (what a card may want next):
 *  - aclnnEmbeddingDenseBackward (8.1.RC1 aclnn_embedding_dense_backward.h):
 *    it writes a whole (V, C) fp32 table rather than adding, so the backward
 *    is aclnnIndexAdd in place instead;
 *  - aclrtCtxSetSysParamOpt: aclnnIndexAdd is non-deterministic by default
 *    (its document), and the contract wants the same bits every run;
 *  - aclnnApplyRotaryPosEmb, aclnnApplyAdamWV2 (qtune's AdamW is the
 *    elementwise operators above, as torch's single-tensor loop),
 *    aclnnCrossEntropyLoss / Grad (they take the whole (N, V) logits, which
 *    the lm_head contract never holds), aclnnIncreFlashAttention (decode uses
 *    FlashAttentionScore with sparse mode 3), aclnnFlashAttentionVarLenScore
 *    (a packed batch as one sequence a document, instead of its mask);
 *  - an fp16 x fp16 -> fp32-out matmul: aclnnMatmul's out must be a type the
 *    inputs' deduced type converts to, and the deduction table (hicann/ops-nn
 *    docs/en/context/deduction_relationship.md) gives FLOAT16 for two FLOAT16
 *    inputs; whether the cube's fp32 sums reach an fp32 out without a
 *    rounding to fp16 first is not documented, so half_matmul answers
 *    QT_EUNSUPPORTED;
 *  - for matvec (decoding, run as the matmul): its contract (a row's bits
 *    whatever N) needs aclnnMatmul's "strong consistency", off by default
 *    and turned on with aclrtCtxSetSysParamOpt (aclnnMatmul_en.md,
 *    Constraints), the same call as above;
 *  - HCCL: declared below, under its own heading. */

/* ==== HCCL: the collectives between cards (src/dist/transport_hccl.c) ======
 * CANN's collective library, libhccl.so. Values and prototypes from CANN's
 * include/hccl/hccl_types.h and include/hccl/hccl.h as the open-sourced
 * cann-hccl repository carries them (inc/hccl/, 2024; the toolkit installs
 * the same two files in include/hccl/). HCCL is opened by the transport, not
 * by the backend: a job on one card never needs libhccl.so. */
typedef enum {
    HCCL_SUCCESS = 0,
    HCCL_E_PARA = 1,
    HCCL_E_PTR = 2,
    HCCL_E_MEMORY = 3,
    HCCL_E_INTERNAL = 4,
    HCCL_E_NOT_SUPPORT = 5,
    HCCL_E_NOT_FOUND = 6,
    HCCL_E_UNAVAIL = 7,
    HCCL_E_SYSCALL = 8,
    HCCL_E_TIMEOUT = 9,
    HCCL_E_OPEN_FILE_FAILURE = 10,
    HCCL_E_TCP_CONNECT = 11,
    HCCL_E_ROCE_CONNECT = 12,
    HCCL_E_TCP_TRANSFER = 13,
    HCCL_E_ROCE_TRANSFER = 14,
    HCCL_E_RUNTIME = 15,
    HCCL_E_DRV = 16,
    HCCL_E_PROFILING = 17,
    HCCL_E_CCE = 18,
    HCCL_E_NETWORK = 19,
    HCCL_E_AGAIN = 20,
    HCCL_E_REMOTE = 21,
    HCCL_E_SUSPENDING = 22,
} HcclResult;
typedef void *HcclComm;
typedef enum { HCCL_REDUCE_SUM = 0, HCCL_REDUCE_PROD = 1, HCCL_REDUCE_MAX = 2, HCCL_REDUCE_MIN = 3 } HcclReduceOp;
typedef enum {
    HCCL_DATA_TYPE_INT8 = 0,
    HCCL_DATA_TYPE_INT16 = 1,
    HCCL_DATA_TYPE_INT32 = 2,
    HCCL_DATA_TYPE_FP16 = 3,
    HCCL_DATA_TYPE_FP32 = 4,
    HCCL_DATA_TYPE_INT64 = 5,
    HCCL_DATA_TYPE_UINT64 = 6,
    HCCL_DATA_TYPE_UINT8 = 7,
    HCCL_DATA_TYPE_UINT16 = 8,
    HCCL_DATA_TYPE_UINT32 = 9,
    HCCL_DATA_TYPE_FP64 = 10,
    HCCL_DATA_TYPE_BFP16 = 11,
} HcclDataType;
/* hccl_types.h: HCCL_ROOT_INFO_BYTES = 4108, the opaque root info rank 0
 * makes and every rank passes to HcclCommInitRootInfo (qtune sends it over MPI) */
#define QT_HCCL_ROOT_INFO_BYTES 4108
typedef struct HcclRootInfoDef {
    char internal[QT_HCCL_ROOT_INFO_BYTES];
} HcclRootInfo;

/* hccl.h. The data types each collective takes (its comments): AllReduce and
 * Reduce int8, int16, int32, float16, float32, bfloat16; ReduceScatter int8,
 * int32, float16, float32, bfloat16; AllGather and Broadcast those and the
 * 64-bit and unsigned ones. Every collective is queued on the stream given
 * and returns; the stream says when it is done. */
#define QT_HCCL_FUNCS(X)                                                                                         \
    X(HcclResult, HcclGetRootInfo, (HcclRootInfo * rootInfo))                                                    \
    X(HcclResult, HcclCommInitRootInfo,                                                                          \
      (uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank, HcclComm *comm))                            \
    X(HcclResult, HcclCommDestroy, (HcclComm comm))                                                              \
    X(HcclResult, HcclAllReduce,                                                                                 \
      (void *sendBuf, void *recvBuf, uint64_t count, HcclDataType dataType, HcclReduceOp op, HcclComm comm,     \
       aclrtStream stream))                                                                                      \
    X(HcclResult, HcclReduce,                                                                                    \
      (void *sendBuf, void *recvBuf, uint64_t count, HcclDataType dataType, HcclReduceOp op, uint32_t root,     \
       HcclComm comm, aclrtStream stream))                                                                       \
    X(HcclResult, HcclReduceScatter,                                                                             \
      (void *sendBuf, void *recvBuf, uint64_t recvCount, HcclDataType dataType, HcclReduceOp op, HcclComm comm, \
       aclrtStream stream))                                                                                      \
    X(HcclResult, HcclAllGather,                                                                                 \
      (void *sendBuf, void *recvBuf, uint64_t sendCount, HcclDataType dataType, HcclComm comm, aclrtStream stream)) \
    X(HcclResult, HcclBroadcast,                                                                                 \
      (void *buf, uint64_t count, HcclDataType dataType, uint32_t root, HcclComm comm, aclrtStream stream))

/* The runtime call the transport waits on a collective's stream with
 * (libascendcl.so): runtime include/external/acl/acl_rt.h,
 * aclrtSynchronizeStreamWithTimeout: timeout in milliseconds, -1 waits
 * forever, 0 only checks whether the stream's work is complete; past it the
 * call answers ACL_ERROR_RT_STREAM_SYNC_TIMEOUT (runtime
 * include/external/acl/error_codes/rt_error_codes.h). */
#define ACL_ERROR_RT_STREAM_SYNC_TIMEOUT 507046
#define QT_HCCL_RT_FUNCS(X) X(aclError, aclrtSynchronizeStreamWithTimeout, (aclrtStream stream, int32_t timeout))


#endif
