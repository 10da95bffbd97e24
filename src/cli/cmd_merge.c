/* qtune merge --model DIR --adapter DIR --out DIR [--dtype f32|bf16|f16]:
 * fold a PEFT LoRA adapter into its base model (W += B @ A * scaling).
 * SIGINT/SIGTERM stop the write: the partial output is removed, --out is left
 * as it was, and the exit status is 130, as for train. A second Ctrl-C exits
 * at once and removes the staging folder (and the folders made for it) on its
 * way out. */
#include "cli/cli.h"
#include "core/progress.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "train/merge.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>

static void help(void) {
    printf("usage: qtune merge --model DIR --adapter DIR --out DIR [--dtype f32|bf16|f16] [--base16 DIR]\n"
           "                   [--device D]\n\n"
           "Merges a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) into\n"
           "its base model as peft's merge_and_unload does: W' = W + (B @ A) * scaling, with\n"
           "scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), computed in fp32\n"
           "and cast once. Writes DIR/model.safetensors, config.json and the tokenizer files.\n\n"
           "  --model DIR    the base model folder the adapter was trained on\n"
           "  --adapter DIR  the adapter folder (e.g. a run's output_dir/final)\n"
           "  --out DIR      the merged model folder to write (not the model or an adapter folder)\n"
           "  --dtype T      store every tensor as T (default: as the base model stores it)\n"
           "  --base16 DIR   with a bitsandbytes 4-bit --model (QLoRA): merge into the 16-bit folder it\n"
           "                 was quantized from (checked: shapes, 4-bit codes, other tensors) instead of\n"
           "                 into its dequantized weights, which is what happens without --base16; either\n"
           "                 way the result is a 16-bit folder, and a line says which and how they differ\n"
           "  --device D     auto (default), cpu, cuda, cuda:N, checked as eval and generate check it\n"
           "                 (cuda where no GPU is visible is an error); the merge itself streams the\n"
           "                 weights through host memory on the CPU whatever D is: B @ A adds r\n"
           "                 multiply-adds per weight, little beside reading and writing the weights\n\n"
           "The files are staged first and moved into DIR when all are complete: an error\n"
           "or Ctrl-C (exit status 130, a second Ctrl-C included) leaves DIR as it was and\n"
           "removes the staged files and any parent folders made for a new DIR.\n");
}

int cmd_merge(int argc, char **argv) {
    if (cli_wants_help(argc, argv)) { help(); return QT_EXIT_OK; }
    const char *model = NULL, *adapter = NULL, *out = NULL, *dtype = NULL, *device = NULL, *base16 = NULL;
    cli_once_list once = {0};
    for (int i = 1; i < argc; i++) {
        const char **dst = !strcmp(argv[i], "--model")     ? &model
                           : !strcmp(argv[i], "--adapter") ? &adapter
                           : !strcmp(argv[i], "--out")     ? &out
                           : !strcmp(argv[i], "--dtype")   ? &dtype
                           : !strcmp(argv[i], "--device")  ? &device
                           : !strcmp(argv[i], "--base16")  ? &base16
                                                           : NULL;
        if (!dst) return cli_usage_error("merge", "unknown argument '%s'", argv[i]);
        if (cli_value(&once, "merge", argv[i], i + 1 < argc ? argv[i + 1] : NULL)) return QT_EXIT_USAGE;
        *dst = argv[++i];
    }
    if (!model || !adapter || !out) return cli_usage_error("merge", "--model, --adapter and --out are all required");
    int dt = -1;
    if (dtype) {
        qt_dtype d;
        if (qt_dtype_parse(dtype, &d) != QT_OK) return cli_usage_error("merge", "--dtype must be f32, bf16 or f16");
        dt = (int)d;
    }
    qt_device dev;
    int st = cli_device("merge", device, &dev);
    if (st != QT_EXIT_OK) return st;
    if (!strcmp(dev.backend, "cuda"))
        qt_info("merge: the merge streams the weights through host memory on the CPU; GPU %d is not used", dev.index);
    volatile sig_atomic_t *stop = cli_stop_on_signals("removing the partial merge");
    char stage[4200], top[4200];
    if (qt_merge_stage_path(out, stage, sizeof stage, top, sizeof top) != QT_OK) return cli_fail();
    cli_remove_on_second_ctrl_c(stage, top);
    qt_progress prog;
    qt_progress_start(&prog, stderr, isatty(2), "merge: writing model.safetensors", 0, "MB");
    int rc = qt_merge_adapter_progress(model, base16, adapter, out, dt, stop, &prog);
    cli_remove_on_second_ctrl_c(NULL, NULL); /* committed into --out, or removed by the merge */
    if (rc == QT_EINTERRUPTED) {
        fprintf(stderr, "qtune: %s\n", qt_error_message());
        return QT_EXIT_INTERRUPTED;
    }
    if (rc != QT_OK) return cli_fail();
    printf("merged %s into %s -> %s\n", adapter, model, out);
    return QT_EXIT_OK;
}
