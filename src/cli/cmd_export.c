/* qtune export --model DIR [--adapter DIR] (--gguf OUT.gguf [--dtype T] | --gguf-lora OUT.gguf):
 * a model (merged with an adapter when one is given) or an adapter alone as
 * the GGUF file llama.cpp loads. See docs/export.md. */
#include "cli/cli.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "export/gguf_export.h"
#include "io/hf_config.h"
#include "text/tokenizer.h"
#include "train/merge.h"

#include <dirent.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void help(void) {
    printf("usage: qtune export --model DIR [--adapter DIR] --gguf OUT.gguf [--dtype f32|f16|bf16|q8_0]\n"
           "       qtune export --model DIR --adapter DIR --gguf-lora OUT.gguf [--dtype f32|f16|bf16]\n\n"
           "Writes a GGUF file that llama.cpp (llama-cli, llama-server, Ollama) loads.\n\n"
           "  --model DIR       Hugging Face model folder (config.json, safetensors, tokenizer.json)\n"
           "  --adapter DIR     PEFT LoRA adapter folder: with --gguf it is merged into the weights\n"
           "                    (W + B A * scaling, as qtune merge); with --gguf-lora it is what is written\n"
           "                    A bitsandbytes 4-bit --model (QLoRA) is written dequantized (16-bit or\n"
           "                    q8_0 from the dequantized values); for its original 16-bit weights give\n"
           "                    --model the folder it was quantized from\n"
           "  --gguf OUT        the whole model, with its tokenizer and chat template\n"
           "  --gguf-lora OUT   the adapter alone, as llama.cpp's LoRA GGUF (llama-cli --lora OUT)\n"
           "  --dtype T         type of the weight matrices: f32, f16, bf16 or q8_0 (8-bit blocks of 32\n"
           "                    with an fp16 scale). Default: the model's torch_dtype for --gguf, f32 for\n"
           "                    --gguf-lora. Norms and biases are always f32.\n\n"
           "The file is written under a temporary name and renamed when complete: an error or\n"
           "Ctrl-C (exit status 130) leaves OUT as it was. Memory stays small whatever the model size.\n");
}

static void merged_source(void *set, const char *name, st_fill_fn *fill, void **ctx) {
    qt_merge_set_lookup(set, name, fill, ctx);
}

static long long file_size(const char *path) {
    struct stat s;
    return stat(path, &s) == 0 ? (long long)s.st_size : -1;
}

/* Whether the existing file o is one that export reads in dir (a .json,
 * .safetensors or .tiktoken file, compared by inode, so other spellings of the
 * path and links count): renaming the GGUF over it would replace the input
 * itself. Its name goes into name. */
static int reads_file(const char *dir, const struct stat *o, char *name, size_t cap) {
    DIR *d = dir ? opendir(dir) : NULL;
    if (!d) return 0;
    int hit = 0;
    for (struct dirent *e; !hit && (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        char p[4096];
        struct stat s;
        const int input = (n > 5 && !strcmp(e->d_name + n - 5, ".json")) ||
                          (n > 12 && !strcmp(e->d_name + n - 12, ".safetensors")) ||
                          bpe_is_tiktoken_file(e->d_name); /* the original Qwen's tokenizer */
        if (input &&
            qt_path_join(p, sizeof p, dir, e->d_name) == QT_OK && stat(p, &s) == 0 && s.st_dev == o->st_dev &&
            s.st_ino == o->st_ino)
            hit = 1, snprintf(name, cap, "%s", e->d_name);
    }
    closedir(d);
    return hit;
}

int cmd_export(int argc, char **argv) {
    if (cli_wants_help(argc, argv)) {
        help();
        return QT_EXIT_OK;
    }
    const char *model = NULL, *adapter = NULL, *gguf = NULL, *lora = NULL, *dtype = NULL;
    cli_once_list once = {0};
    for (int i = 1; i < argc; i++) {
        const char **dst = !strcmp(argv[i], "--model")       ? &model
                           : !strcmp(argv[i], "--adapter")   ? &adapter
                           : !strcmp(argv[i], "--gguf")      ? &gguf
                           : !strcmp(argv[i], "--gguf-lora") ? &lora
                           : !strcmp(argv[i], "--dtype")     ? &dtype
                                                             : NULL;
        if (!dst) return cli_usage_error("export", "unknown argument '%s'", argv[i]);
        if (cli_value(&once, "export", argv[i], i + 1 < argc ? argv[i + 1] : NULL)) return QT_EXIT_USAGE;
        *dst = argv[++i];
    }
    if (!model) return cli_usage_error("export", "--model DIR is required");
    if ((gguf != NULL) == (lora != NULL)) return cli_usage_error("export", "give exactly one of --gguf OUT or --gguf-lora OUT");
    if (lora && !adapter) return cli_usage_error("export", "--gguf-lora needs --adapter DIR (the adapter to write)");
    gguf_export_opts o = {GGUF_F32, NULL, NULL, NULL, stderr, isatty(2), NULL, NULL};
    if (dtype && gguf_type_parse(dtype, &o.type) != QT_OK)
        return cli_usage_error("export", "--dtype must be f32, f16, bf16 or q8_0, not '%s'", dtype);
    const char *out = gguf ? gguf : lora;
    if (!out[0])
        return cli_usage_error("export", "%s needs the name of the .gguf file to write", gguf ? "--gguf" : "--gguf-lora");
    struct stat os;
    char in[256];
    const char *dirs[] = {model, adapter};
    for (int k = 0; k < 2 && stat(out, &os) == 0; k++)
        if (reads_file(dirs[k], &os, in, sizeof in))
            return cli_usage_error("export", "%s %s is an input of the export (the %s's %s), which the GGUF file would "
                                   "replace; name a new .gguf file", gguf ? "--gguf" : "--gguf-lora", out,
                                   k ? "adapter" : "model", in);
    if (qt_is_dir(out)) return cli_usage_error("export", "%s is a folder; name the .gguf file to write", out);

    /* the base model first, so a wrong --model is reported as such */
    st_file *base = NULL;
    qt_merge_set *set = NULL;
    int rc = qt_merge_open_model(model, &base);
    qt_config mcfg;
    if (rc == QT_OK) rc = qt_config_load(model, &mcfg);
    /* a bitsandbytes 4-bit folder: its weights written dequantized (with the adapter merged in, when given) */
    if (rc == QT_OK && (adapter || (gguf && mcfg.prequant4)))
        rc = qt_merge_set_open(model, adapter, base, &set);
    if (rc == QT_OK && set && gguf && qt_merge_set_unties(set))
        rc = QT_ERR(QT_EUNSUPPORTED, "%s trains modules_to_save on a model with tied embeddings, so the merged model "
                    "needs its own lm_head; run qtune merge first and export the merged folder", adapter);
    if (rc == QT_OK && gguf && !dtype) {
        qt_config cfg;
        rc = qt_config_load(model, &cfg);
        if (rc == QT_OK)
            o.type = cfg.torch_dtype == QT_BF16 ? GGUF_BF16 : cfg.torch_dtype == QT_F16 ? GGUF_F16 : GGUF_F32;
    }
    if (rc == QT_OK && gguf && set && qt_merge_set_dequantizes(set))
        qt_info("%s is a bitsandbytes 4-bit folder: its %d 4-bit weights are written dequantized%s (the weights "
                "the adapter was trained on; to export the original 16-bit weights, give --model the folder it was "
                "quantized from)", model, qt_merge_set_dequantizes(set), adapter ? ", with the adapter merged in" : "");
    /* the output's parent folders, as merge makes them (and removes them again when the export fails) */
    char parent[4096], made_top[4096] = "";
    qt_path_dirname(parent, sizeof parent, out);
    if (rc == QT_OK && qt_path_missing_top(parent, made_top, sizeof made_top) != QT_OK) {
        made_top[0] = 0;
        qt_error_clear(); /* the write below names the path */
    }
    if (rc == QT_OK && made_top[0]) rc = qt_mkdir_p(parent);
    o.stop = cli_stop_on_signals("removing the partial GGUF file");
    const double t0 = qt_now_s();
    const int writing = rc == QT_OK;
    if (rc == QT_OK && gguf) {
        o.source = set ? merged_source : NULL;
        o.source_ctx = set;
        o.base = base; /* the merge reads the same mapping */
        rc = gguf_export_model(model, gguf, &o);
    } else if (rc == QT_OK) {
        rc = gguf_export_lora(model, adapter, lora, &o);
    }
    qt_merge_set_free(set);
    st_close(base);
    if (rc != QT_OK && made_top[0]) qt_rmdir_made(parent, made_top);
    if (rc == QT_EINTERRUPTED) {
        fprintf(stderr, "qtune: %s\n", qt_error_message());
        return QT_EXIT_INTERRUPTED;
    }
    if (rc == QT_ENUMERIC && writing) { /* the writer named the tensor (its GGUF name) */
        char what[512];
        snprintf(what, sizeof what, "%s", qt_error_message());
        QT_ERR(rc, "%s%s%s: %s; qtune writes no NaN or infinite weights (generate, eval and train refuse them), so "
               "%s was not written", lora ? adapter : model, set && gguf ? " merged with " : "",
               set && gguf ? adapter : "", what, out);
    }
    if (rc != QT_OK) return cli_fail();
    printf("wrote %s (%s, %.1f MiB, %.1f s)%s%s\n", out, gguf_type_name(o.type), file_size(out) / 1048576.0,
           qt_now_s() - t0, set && gguf ? " merged with " : "", set && gguf ? adapter : "");
    return QT_EXIT_OK;
}
