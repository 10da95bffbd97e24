/* The CUDA backend's 4-bit dequantization (src/backend/cuda/
 * quant4_kernels.cuh: q4_value, which the matmul's dequantize kernel and the
 * decode matvec read), run on the CPU by cuda_emu.h, against the CPU's
 * qt_q4_dequantize (core/quant4.c, itself bit-exact with bitsandbytes):
 * NF4 and FP4, with and without double quantization, values rounded to f32,
 * bf16 and f16, blocksizes 64 and 128, sizes that end inside a block and on
 * an odd value, and a row view (the original Qwen's k and v inside c_attn).
 * Every value must be equal bit for bit: the kernel's arithmetic is the
 * CPU's, multiplies and adds kept apart. A small grid, so the grid-stride
 * loop runs more than once. */
#include "cuda_emu.h"

#include <cstdio>
#include <cstring>
#include <random>

extern "C" {
#include "core/quant4.h"
}
#include "backend/cuda/quant4_kernels.cuh"

static int failures;

static void compare(const char *what, const std::vector<float> &ref, const std::vector<float> &got) {
    size_t bad = 0, first = ref.size();
    for (size_t i = 0; i < ref.size(); i++)
        if (memcmp(&ref[i], &got[i], 4)) {
            if (!bad++) first = i;
        }
    printf("  %-46s %zu values, %zu differ%s\n", what, ref.size(), bad, bad ? "  FAILED" : "");
    if (bad) printf("    first at %zu: cpu %.9g, kernel %.9g\n", first, ref[first], got[first]);
    failures += bad != 0;
}

static std::vector<float> kernel(const qt_q4_weight *w, size_t n) {
    std::vector<float> out(n, NAN);
    qt_emu_launch({3, 1, 1}, 64, 0, [&] { k_q4_dequantize(out.data(), w, n); });
    return out;
}

static void run_case(qt_q4_type t, int nested, qt_dtype dt, int bs, uint64_t rows, uint64_t cols) {
    char what[128];
    snprintf(what, sizeof what, "%s%s %s bs%d [%llu, %llu]", qt_q4_type_name(t), nested ? " nested" : "",
             qt_dtype_name(dt), bs, (unsigned long long)rows, (unsigned long long)cols);
    const size_t n = (size_t)(rows * cols), bytes = qt_q4_bytes(rows, cols, bs, nested);
    std::mt19937 rng((unsigned)(n * 31 + (size_t)t * 7 + (size_t)nested));
    std::normal_distribution<float> d(0.0f, 0.05f);
    std::vector<float> x(n);
    for (auto &v : x) v = d(rng);
    x[n / 3] = 0.9f; /* a block with a large absmax among small ones */
    std::vector<uint64_t> mem(bytes / 8 + 1);
    auto *w = (qt_q4_weight *)mem.data();
    qt_q4_init(w, t, dt, rows, cols, bs, nested);
    if (qt_q4_quantize_weight(w, x.data(), QT_F32) != 0) {
        printf("  %s: quantize failed\n", what);
        failures++;
        return;
    }
    std::vector<float> ref(n);
    qt_q4_dequantize(w, 0, n, ref.data());
    compare(what, ref, kernel(w, n));
    /* rows [r0, r0 + vr) as a view header of its own, as the loader makes for k and v */
    if (rows >= 3) {
        const uint64_t r0 = rows / 3, vr = rows - r0 - 1;
        qt_q4_weight view;
        qt_q4_view(w, w, &view, r0, vr, &view);
        std::vector<float> vref(vr * cols);
        qt_q4_dequantize(&view, 0, vr * cols, vref.data());
        snprintf(what + strlen(what), sizeof what - strlen(what), " rows %llu+%llu", (unsigned long long)r0,
                 (unsigned long long)vr);
        compare(what, vref, kernel(&view, vr * cols));
    }
}

int main() {
    const qt_dtype dts[3] = {QT_F32, QT_BF16, QT_F16};
    for (int t = 0; t < 2; t++)
        for (int nested = 0; nested < 2; nested++)
            for (qt_dtype dt : dts) {
                run_case((qt_q4_type)t, nested, dt, 64, 24, 40);  /* 960 values: the last block partial */
                run_case((qt_q4_type)t, nested, dt, 64, 7, 37);   /* 259: odd, the last byte half used */
            }
    run_case(QT_Q4_NF4, 1, QT_BF16, 128, 40, 80);  /* a folder's other blocksize */
    run_case(QT_Q4_NF4, 1, QT_BF16, 64, 150, 128); /* 300 absmax blocks: two nested blocks */
    printf("%s\n", failures ? "FAILED" : "all equal");
    return failures ? 1 : 0;
}
