/* qtune init: write a randomly initialised Hugging Face model folder from a
 * preset or a config.json: config.json, model.safetensors (streamed, so a
 * model larger than memory can be written), generation_config.json and, with
 * --tokenizer, tokenizer.json + tokenizer_config.json, or for the original
 * Qwen its qwen.tiktoken + tokenizer_config.json. */
#include "cli/cli.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/progress.h"
#include "io/hf_config.h"
#include "io/model_folder.h"
#include "text/tokenizer.h"

#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>

static void init_help(void) {
    printf("usage: qtune init --out DIR (--preset NAME | --config FILE.json) [--dtype f32|bf16|f16]\n"
           "                  [--seed N] [--tokenizer FILE] [--force]\n\n"
           "Writes a randomly initialised model folder that transformers loads as is:\n"
           "DIR/config.json, DIR/model.safetensors, DIR/generation_config.json and, with\n"
           "--tokenizer, DIR/tokenizer.json and DIR/tokenizer_config.json (ChatML template),\n"
           "or for the original Qwen given a .tiktoken file, DIR/qwen.tiktoken and its\n"
           "DIR/tokenizer_config.json (QWenTokenizer; transformers also needs Qwen's\n"
           "tokenization_qwen.py, which qtune does not write).\n"
           "Weights follow transformers' init: normal(0, 0.02) for linear and embedding\n"
           "weights, zeros for biases, ones for norms, drawn from --seed.\n\n"
           "options:\n"
           "  --out DIR         folder to write (created; must be empty unless --force)\n"
           "  --preset NAME     a shape from the list below (any case)\n"
           "  --config FILE     a config.json (Qwen2, Qwen3, original Qwen or Llama) instead of a preset\n"
           "  --dtype T         stored dtype: f32 (default), bf16 or f16\n"
           "  --seed N          random seed (default 42)\n"
           "  --tokenizer FILE  a Qwen tokenizer.json to copy in, or (original Qwen presets and\n"
           "                    configs) a qwen.tiktoken\n"
           "  --force           write into a non-empty DIR, replacing the files above\n\n"
           "presets:\n");
    for (int i = 0; i < qt_preset_count(); i++) {
        qt_config c;
        if (qt_preset(qt_preset_name(i), &c) != QT_OK) continue;
        double p = (double)qt_config_param_count(&c);
        if (p >= 1e9) printf("  %-13s %6.2fB  %s\n", qt_preset_name(i), p / 1e9, qt_preset_summary(i));
        else printf("  %-13s %6.1fM  %s\n", qt_preset_name(i), p / 1e6, qt_preset_summary(i));
    }
}

/* 1 if dir holds anything besides . and .. */
static int dir_nonempty(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *e;
    int any = 0;
    while (!any && (e = readdir(d)))
        any = strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return any;
}

/* The original Qwen's tokenizer files: the .tiktoken copied in as DIR/qwen.tiktoken (the name
 * Qwen's tokenization_qwen.py and qtune look for) and the tokenizer_config.json Qwen's folders
 * carry, which names that class through auto_map. */
static int tiktoken_files_write(const qt_config *cfg, const char *tiktoken, const char *out) {
    char path[4096], text[512];
    QT_TRY(qt_path_join(path, sizeof path, out, "qwen.tiktoken"));
    QT_TRY(qt_copy_file(tiktoken, path));
    int n = snprintf(text, sizeof text,
                     "{\n"
                     "  \"model_max_length\": %d,\n"
                     "  \"tokenizer_class\": \"QWenTokenizer\",\n"
                     "  \"auto_map\": {\n"
                     "    \"AutoTokenizer\": [\n"
                     "      \"tokenization_qwen.QWenTokenizer\",\n"
                     "      null\n"
                     "    ]\n"
                     "  }\n"
                     "}\n",
                     cfg->max_position_embeddings);
    QT_TRY(qt_path_join(path, sizeof path, out, "tokenizer_config.json"));
    return qt_write_file_atomic(path, text, (size_t)n);
}

/* Reads a qwen.tiktoken (ranks, then Qwen's special tokens after them) for the ids init needs. */
static int tiktoken_ids_read(const qt_config *cfg, const char *path, qt_tokenizer_ids *ids) {
    if (cfg->arch != QT_ARCH_QWEN)
        return QT_ERR(QT_EINVAL, "--tokenizer %s is a qwen.tiktoken, the original Qwen's tokenizer, but the model is %s; use an original-Qwen preset (qwen-14b, tiny-qwen, ...) or give a tokenizer.json",
                      path, qt_arch_name(cfg->arch));
    bpe_tokenizer *t;
    QT_TRY(bpe_load(path, &t));
    ids->max_id = bpe_vocab_size(t) - 1;
    ids->endoftext = bpe_token_id(t, "<|endoftext|>");
    ids->im_start = bpe_token_id(t, "<|im_start|>");
    ids->im_end = bpe_token_id(t, "<|im_end|>");
    bpe_free(t);
    return QT_OK;
}

static int write_folder(const char *out, const qt_config *cfg, qt_dtype dtype, uint64_t seed, const char *tokenizer) {
    char path[4096];
    int64_t params = qt_config_param_count(cfg);
    int64_t bytes = params * (int64_t)qt_dtype_size(dtype);
    int64_t free_b = qt_free_disk_bytes(out);
    if (free_b >= 0 && free_b < bytes + (1 << 20))
        return QT_ERR(QT_EIO, "%s has %.2f GB free but the weights need %.2f GB; free disk space or choose --dtype bf16",
                      out, (double)free_b / 1e9, (double)bytes / 1e9);
    if (tokenizer)
        QT_TRY(bpe_is_tiktoken_file(tokenizer) ? tiktoken_files_write(cfg, tokenizer, out)
                                               : qt_tokenizer_files_write(cfg, tokenizer, out));
    QT_TRY(qt_path_join(path, sizeof path, out, "config.json"));
    QT_TRY(qt_config_write(cfg, path));
    QT_TRY(qt_generation_config_write(cfg, out));
    /* A stale index from an earlier sharded model would shadow nothing
     * (model.safetensors wins), but it would mislead other tools. */
    QT_TRY(qt_path_join(path, sizeof path, out, "model.safetensors.index.json"));
    if (qt_path_exists(path)) remove(path);
    QT_TRY(qt_path_join(path, sizeof path, out, "model.safetensors"));
    fprintf(stderr, "qtune: writing %s: %lld parameters as %s, %.2f GB\n", path, (long long)params,
            qt_dtype_name(dtype), (double)bytes / 1e9);
    qt_progress prog;
    qt_progress_start(&prog, stderr, isatty(2), "init", (double)params, "parameters");
    int rc = qt_init_weights_write_progress(cfg, dtype, seed, path, &prog);
    qt_progress_end(&prog);
    QT_TRY(rc);
    return qt_fsync_dir(out);
}

int cmd_init(int argc, char **argv) {
    if (cli_wants_help(argc, argv)) {
        init_help();
        return QT_EXIT_OK;
    }
    const char *out = NULL, *preset = NULL, *config = NULL, *dtype_s = "f32", *tokenizer = NULL;
    uint64_t seed = 42;
    int force = 0;
    cli_once_list once = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char **dst = !strcmp(a, "--out") ? &out : !strcmp(a, "--preset") ? &preset
                         : !strcmp(a, "--config") ? &config : !strcmp(a, "--dtype") ? &dtype_s
                         : !strcmp(a, "--tokenizer") ? &tokenizer : NULL;
        if (dst) {
            if (cli_value(&once, "init", a, i + 1 < argc ? argv[i + 1] : NULL)) return QT_EXIT_USAGE;
            *dst = argv[++i];
        } else if (!strcmp(a, "--seed")) {
            if (cli_value(&once, "init", a, i + 1 < argc ? argv[i + 1] : NULL)) return QT_EXIT_USAGE;
            char *end;
            errno = 0;
            unsigned long long v = strtoull(argv[++i], &end, 10);
            if (errno || *end || !argv[i][0] || argv[i][0] == '-')
                return cli_usage_error("init", "--seed '%s' is not a non-negative integer", argv[i]);
            seed = (uint64_t)v;
        } else if (!strcmp(a, "--force")) {
            force = 1;
        } else {
            return cli_usage_error("init", "unknown option '%s'", a);
        }
    }
    if (!out) return cli_usage_error("init", "--out DIR is required");
    if (!preset == !config) return cli_usage_error("init", "give exactly one of --preset NAME or --config FILE.json");
    qt_dtype dtype;
    if (qt_dtype_parse(dtype_s, &dtype) != QT_OK)
        return cli_usage_error("init", "--dtype '%s' is not one of f32, bf16, f16", dtype_s);

    qt_config cfg;
    if ((preset ? qt_preset(preset, &cfg) : qt_config_load(config, &cfg)) != QT_OK) return cli_fail();
    cfg.torch_dtype = dtype;
    if (tokenizer) {
        /* Ids absent from the config (the tiny presets) come from the tokenizer. */
        qt_tokenizer_ids ids;
        if ((bpe_is_tiktoken_file(tokenizer) ? tiktoken_ids_read(&cfg, tokenizer, &ids)
                                              : qt_tokenizer_ids_read(tokenizer, &ids)) != QT_OK)
            return cli_fail();
        if (ids.max_id >= cfg.vocab_size) { /* refuse before creating anything */
            QT_ERR(QT_EINVAL, "%s has token ids up to %d but the model's vocab_size is %d; use a preset sized for this tokenizer (e.g. demo) or a config with a larger vocab_size",
                   tokenizer, ids.max_id, cfg.vocab_size);
            return cli_fail();
        }
        if (bpe_is_tiktoken_file(tokenizer)) { /* the original Qwen ends text with <|endoftext|>, as its generation_config.json says */
            if (cfg.eos_token_id < 0) cfg.eos_token_id = ids.endoftext;
        } else {
            if (cfg.bos_token_id < 0) cfg.bos_token_id = ids.endoftext;
            if (cfg.eos_token_id < 0) cfg.eos_token_id = ids.im_end;
        }
    }
    if (qt_path_exists(out) && !qt_is_dir(out)) {
        QT_ERR(QT_EINVAL, "--out %s exists and is not a folder; choose another path", out);
        return cli_fail();
    }
    if (dir_nonempty(out) && !force) {
        QT_ERR(QT_EINVAL, "--out %s is not empty; choose an empty folder or pass --force to replace the model files in it", out);
        return cli_fail();
    }
    char top[4096]; /* the highest folder this run makes ("": out exists) */
    if (qt_path_missing_top(out, top, sizeof top) != QT_OK) return cli_fail();
    if (qt_mkdir_p(out) != QT_OK) {
        if (top[0]) qt_rmdir_made(out, top); /* the parents made before the mkdir that failed */
        return cli_fail();
    }

    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (write_folder(out, &cfg, dtype, seed, tokenizer) != QT_OK) {
        if (top[0]) { /* the folders this run made: nothing of the user's is in them */
            (void)qt_rm_rf(out);
            qt_rmdir_made(out, top);
        }
        return cli_fail();
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    int64_t params = qt_config_param_count(&cfg);
    printf("wrote %s: %s, %lld parameters (%.1f MB as %s), seed %llu, %.1f s\n", out, preset ? preset : config,
           (long long)params, (double)params * (double)qt_dtype_size(dtype) / 1e6, qt_dtype_name(dtype),
           (unsigned long long)seed, secs);
    return QT_EXIT_OK;
}
