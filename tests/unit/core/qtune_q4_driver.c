/* Drives core/quant4.c for tests/quant/test_quant4_ref.py:
 *   qtune_q4_driver IN.f32 ROWS COLS nf4|fp4 NESTED f32|bf16|f16 OUTDIR
 * reads ROWS*COLS float32 values (already representable in the dtype),
 * quantizes them as a (ROWS, COLS) weight stored in that dtype and writes
 * OUTDIR/packed.bin, absmax.bin (f32, or u8 when nested), absmax2.bin and
 * offset.f32 (nested), dequant.f32 (the whole weight, qt_q4_dequantize) and
 * dequant_rows.f32 (the same by odd ranges, the unaligned path), plus
 * tables.f32 (nf4, fp4, dynamic map). */
#include <stdio.h>
#include <stdlib.h>

#include "core/dtype.h"
#include "core/quant4.h"

static void put(const char *dir, const char *name, const void *p, size_t bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, bytes, f) != bytes) { perror(path); exit(2); }
    fclose(f);
}

int main(int argc, char **argv) {
    if (argc != 8) { fprintf(stderr, "usage: %s IN.f32 ROWS COLS nf4|fp4 NESTED DTYPE OUTDIR\n", argv[0]); return 2; }
    size_t rows = strtoull(argv[2], NULL, 10), cols = strtoull(argv[3], NULL, 10), n = rows * cols;
    qt_q4_type t = argv[4][0] == 'f' ? QT_Q4_FP4 : QT_Q4_NF4;
    int nested = atoi(argv[5]);
    qt_dtype dt;
    if (qt_dtype_parse(argv[6], &dt)) return 2;
    const char *out = argv[7];
    float *x = malloc(n * 4 + 4), *deq = malloc(n * 4 + 4);
    void *xs = malloc(n * 4 + 4);
    FILE *f = fopen(argv[1], "rb");
    if (!f || fread(x, 4, n, f) != n) { perror(argv[1]); return 2; }
    fclose(f);
    qt_convert_from_f32(xs, dt, x, n);
    size_t bytes = qt_q4_bytes(rows, cols, QT_Q4_BLOCK, nested);
    qt_q4_weight *w = aligned_alloc(64, (bytes + 63) / 64 * 64);
    qt_q4_init(w, t, dt, rows, cols, QT_Q4_BLOCK, nested);
    if (qt_q4_check(w, bytes, "driver") || qt_q4_quantize_weight(w, xs, dt)) return 3;
    put(out, "packed.bin", qt_q4_packed(w), (n + 1) / 2);
    put(out, "absmax.bin", qt_q4_absmax(w), w->nb * (nested ? 1 : 4));
    if (nested) {
        put(out, "absmax2.bin", qt_q4_absmax2(w), w->nb2 * 4);
        put(out, "offset.f32", &w->offset, 4);
    }
    qt_q4_dequantize(w, 0, n, deq);
    put(out, "dequant.f32", deq, n * 4);
    for (size_t e = 0; e < n;) { /* ranges of 1, 2, ... 97 values: starts and ends off the blocks */
        static size_t len = 1;
        size_t e1 = e + len < n ? e + len : n;
        qt_q4_dequantize(w, e, e1, deq + e);
        e = e1, len = len % 97 + 1;
    }
    put(out, "dequant_rows.f32", deq, n * 4);
    /* every SIMD path compiled in must give the same bits: scalar, AVX2 (and AVX-512, the default where built) */
    for (int level = 0; level < 2; level++) {
        int was = qt_q4_set_simd(level);
        qt_q4_dequantize(w, 0, n, deq);
        qt_q4_set_simd(was);
        put(out, level ? "dequant_avx2.f32" : "dequant_scalar.f32", deq, n * 4);
    }
    if (rows > 1) { /* rows [1, rows) through a view in a header of its own */
        qt_q4_weight view;
        qt_q4_view(w, w, &view, 1, rows - 1, &view);
        if (qt_q4_check(&view, sizeof view, "view")) return 3;
        qt_q4_dequantize(&view, 0, (rows - 1) * cols, deq);
        put(out, "dequant_view.f32", deq, (rows - 1) * cols * 4);
    }
    float tables[16 + 16 + 256];
    for (int i = 0; i < 16; i++) tables[i] = qt_q4_nf4_code[i], tables[16 + i] = qt_q4_fp4_code[i];
    for (int i = 0; i < 256; i++) tables[32 + i] = qt_q8_dynamic_map()[i];
    put(out, "tables.f32", tables, sizeof tables);
    free(x), free(deq), free(xs), free(w);
    return 0;
}
