/* qtune doctor: the environment report, the job check, and the table of
 * known failures (see doctor.h and docs/doctor.md). Nothing here changes the
 * machine or the job; every check only reads. */
#include "train/doctor.h"
#include "train/doctor_npu.h"

#include "backend/device.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "core/log.h"
#include "core/messages.h"
#include "data/format.h"
#include "data/lines.h"
#include "data/source.h"
#include "io/hf_config.h"
#include "core/quant4.h"
#include "io/safetensors.h"
#include "model/lora_io.h"
#include "model/model.h"
#include "optim/loss_scaler.h"
#include "data/preview.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "train/ds_config.h"
#include "train/job.h"
#include "train/plan_report.h"
#include "train/run_setup.h"
#include "qtune_config.h"

#include <cblas.h>
#include <cjson/cJSON.h>
#include <cpuid.h>
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <dirent.h>
#include <omp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#if QTUNE_HAVE_MPI
#include <mpi.h>
#endif

#define GIB (1024.0 * 1024.0 * 1024.0)

/* ---- the table of known failures ------------------------------------------ */

static const qt_known_failure failures[] = {
    {"the run stops while loading or at the first step with 'could not allocate ...'",
     "weights + gradients + optimizer state + activations exceed the memory of a card or the host",
     "run `qtune plan` with the job's settings; turn on train.gradient_checkpointing, use ZeRO stage 2 "
     "(with offload_optimizer.device cpu), a smaller train_micro_batch_size_per_gpu or data.seq_len, or LoRA",
     QT_MSG_OOM_FMT, "QT_MSG_OOM_FMT"},
    {"every rank stops after a long pause with 'collective ... did not complete within ...'",
     "one rank died (often the kernel's OOM killer) or stalls (slow disk, swap, a hung network link)",
     "read the named rank's log and `dmesg` for the OOM killer; check the network between hosts; raise "
     "QTUNE_DIST_TIMEOUT (seconds) when steps are simply slower than the deadline",
     QT_MSG_DIST_TIMEOUT_FMT, "QT_MSG_DIST_TIMEOUT_FMT"},
    {"tokens_per_s in metrics.jsonl falls far below the first steps, with 'the training step waited for data'",
     "the data loader cannot keep up (too few workers, a slow or network disk), or OpenMP threads x ranks "
     "oversubscribe the cores and the loader starves",
     "raise data.num_workers or data.prefetch, put data.cache_dir on a local disk, and keep "
     "OMP_NUM_THREADS x ranks per host <= cores (see the environment report above)",
     QT_MSG_LOADER_STARVED_FMT, "QT_MSG_LOADER_STARVED_FMT"},
    {"fp16 training: loss_scale in metrics.jsonl keeps halving, every step is skipped, then the run stops",
     "gradients overflow fp16 at every scale: a learning rate too high for fp16, bad data (very long or "
     "repeated tokens), or weights outside fp16's range",
     "lower the learning rate or lengthen warmup, keep gradient_clipping at 1.0, check the data; use bf16 on "
     "hardware that has it, or fp32",
     QT_MSG_LOSS_SCALE_FLOOR_FMT, "QT_MSG_LOSS_SCALE_FLOOR_FMT"},
    {"`qtune generate --chat` with a LoRA model never stops, or repeats the prompt",
     "the base model never learned ChatML's <|im_end|> (a base, not an instruct model), and a LoRA adapter on "
     "attention projections cannot teach it a new token's embedding",
     "use the instruct model as the base, or train the embedding and lm_head too (lora.modules_to_save "
     "[\"embed_tokens\", \"lm_head\"] beside the adapter, or full fine-tuning); "
     "meanwhile cap replies with --max-new",
     QT_MSG_CHAT_UNTRAINED_FMT, "QT_MSG_CHAT_UNTRAINED_FMT"},
    {"LoRA on an original Qwen model (Qwen-7B/14B/72B) stops at once with 'target_modules names q_proj, v_proj, "
     "which do not exist'",
     "the original Qwen (QWenLMHeadModel) has no q_proj/k_proj/v_proj: its q, k and v are one fused c_attn (PEFT "
     "itself stops with \"Target modules {...} not found in the base model\")",
     "write lora.target_modules with the model's own names: [\"c_attn\"] for q/k/v, c_proj (attention and MLP "
     "output), w1 and w2 (the MLP)",
     QT_MSG_QWEN1_TARGETS_FMT, "QT_MSG_QWEN1_TARGETS_FMT"},
};

const qt_known_failure *qt_doctor_known_failures(int *n) {
    *n = (int)(sizeof failures / sizeof failures[0]);
    return failures;
}

void qt_doctor_render_format(const char *fmt, char *out, size_t cap) {
    size_t o = 0;
    if (!cap) return;
    for (const char *p = fmt; *p && o + 1 < cap;) {
        if (*p != '%') {
            out[o++] = *p++;
            continue;
        }
        p++;
        if (*p == '%') {
            out[o++] = '%';
            p++;
            continue;
        }
        while (*p && strchr("-+ #0123456789.*lhzjtL", *p)) p++; /* flags, width, precision, length */
        const char *ph = (*p == 's' || *p == 'c') ? "<text>" : "<number>";
        if (*p) p++;
        for (const char *q = ph; *q && o + 1 < cap; q++) out[o++] = *q;
    }
    out[o] = 0;
}

void qt_doctor_print_failures(FILE *f) {
    int n;
    const qt_known_failure *t = qt_doctor_known_failures(&n);
    fprintf(f, "known failures (symptom, cause, fix, and the exact message qtune prints)\n");
    for (int i = 0; i < n; i++) {
        char msg[1024];
        qt_doctor_render_format(t[i].message, msg, sizeof msg);
        fprintf(f, "\n%d. %s\n   cause:   %s\n   fix:     %s\n   message: %s\n", i + 1, t[i].symptom, t[i].cause,
                t[i].fix, msg);
    }
}

/* ---- environment ---------------------------------------------------------- */

static void cpu_model(char *out, size_t cap) {
    snprintf(out, cap, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10)) {
            char *c = strchr(line, ':');
            if (c) {
                c++;
                while (*c == ' ') c++;
                c[strcspn(c, "\n")] = 0;
                snprintf(out, cap, "%s", c);
            }
            break;
        }
    fclose(f);
}

static void print_mpi(FILE *f) {
#if QTUNE_HAVE_MPI
    char v[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(v, &len); /* callable before MPI_Init */
    v[strcspn(v, "\n,")] = 0;
    fprintf(f, "mpi        %s (launch with `mpirun -np N qtune train JOB.json`)\n", v);
#else
    fprintf(f, "mpi        this build has no MPI: one process only (install libopenmpi-dev and rebuild)\n");
#endif
}

int qt_doctor_environment(FILE *f, int ranks) {
    int warnings = 0;
    char model[256];
    cpu_model(model, sizeof model);
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    fprintf(f, "qtune      %s (MPI %s, CUDA %s, oneDNN %s)\n", QTUNE_VERSION, QTUNE_HAVE_MPI ? "on" : "off",
            QTUNE_HAVE_CUDA ? "on" : "off", QTUNE_HAVE_DNNL ? "on" : "off");
    fprintf(f, "cpu        %s, %ld logical cores\n", model, cores);
    __builtin_cpu_init();
    /* F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports has no "f16c" */
    unsigned ca = 0, cb = 0, cc = 0, cd = 0;
    const int f16c = __get_cpuid(1, &ca, &cb, &cc, &cd) && (cc >> 29 & 1u);
    const int avx2 = __builtin_cpu_supports("avx2");
    const int avx512 = __builtin_cpu_supports("avx512f"), bf16 = __builtin_cpu_supports("avx512bf16");
    fprintf(f, "           AVX2 %s, F16C %s, AVX-512F %s, AVX512_BF16 %s\n", avx2 ? "yes" : "no", f16c ? "yes" : "no",
            avx512 ? "yes" : "no", bf16 ? "yes" : "no");
    if (!avx2 || !f16c) {
        fprintf(f, "  warning: this CPU lacks AVX2/F16C, which qtune's kernels are compiled for; expect a crash "
                   "(illegal instruction) and rebuild on this machine with -DQTUNE_NATIVE=ON\n");
        warnings++;
    }
    if (!bf16)
        fprintf(f, "           no native bf16 on this CPU: bf16 training stops (use fp16 or fp32)\n");

    const char *cfg = openblas_get_config();
    const int par = openblas_get_parallel();
    fprintf(f, "blas       %s; %s threading, %d thread%s\n", cfg ? cfg : "?",
            par == 0 ? "single" : par == 1 ? "pthreads" : "OpenMP", openblas_get_num_threads(),
            openblas_get_num_threads() == 1 ? "" : "s");
    const char *was = getenv("QTUNE_BLAS_CORE_WAS");
    if (was && *was)
        fprintf(f, "           OpenBLAS took its %s kernels on this CPU; qtune set OPENBLAS_CORETYPE=%s (the CPU's "
                   "own instructions; set OPENBLAS_CORETYPE yourself to choose)\n",
                was, getenv("OPENBLAS_CORETYPE") ? getenv("OPENBLAS_CORETYPE") : "?");
    const int omp = omp_get_max_threads();
    const char *omp_env = getenv("OMP_NUM_THREADS");
    fprintf(f, "openmp     %d thread%s per process (OMP_NUM_THREADS %s), %d rank%s on this host\n", omp,
            omp == 1 ? "" : "s", omp_env ? omp_env : "unset", ranks, ranks == 1 ? "" : "s");
    if ((long)omp * ranks > cores && cores > 0) {
        fprintf(f, "  warning: %d threads x %d ranks = %ld > %ld cores: threads will fight for cores and steps "
                   "slow down many times; set OMP_NUM_THREADS=%ld\n",
                omp, ranks, (long)omp * ranks, cores, cores / ranks > 0 ? cores / ranks : 1);
        warnings++;
    }
    if (par == 1 && openblas_get_num_threads() > 1 && omp > 1)
        fprintf(f, "           OpenBLAS runs its own pthreads next to OpenMP; if cores look oversubscribed, set "
                   "OPENBLAS_NUM_THREADS=1\n");
    print_mpi(f);
    qt_cuda_driver_report(f);
    warnings += qt_doctor_npu_report(f);

    const int64_t total = qt_meminfo_kib("MemTotal"), avail = qt_meminfo_kib("MemAvailable");
    if (total > 0 && avail >= 0)
        fprintf(f, "memory     %.1f GiB available of %.1f GiB\n", (double)avail * 1024 / GIB, (double)total * 1024 / GIB);
    char cwd[4096];
    if (getcwd(cwd, sizeof cwd)) {
        int64_t fr = qt_free_disk_bytes(cwd);
        if (fr >= 0) fprintf(f, "disk       %.1f GiB free in %s\n", (double)fr / GIB, cwd);
    }
    return warnings;
}

/* ---- the job check -------------------------------------------------------- */

typedef struct {
    FILE *f;
    const char *where;
    int n;
} doc_ctx;

static void problem(doc_ctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void problem(doc_ctx *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(c->f, "  problem: ");
    vfprintf(c->f, fmt, ap);
    fprintf(c->f, "\n");
    va_end(ap);
    c->n++;
}

/* A path in the job, relative to the job file's folder. */
static void job_path(const char *dir, const char *p, char *out, size_t cap) {
    if (p[0] == '/' || !strcmp(dir, ".") || qt_path_join(out, cap, dir, p) != QT_OK) snprintf(out, cap, "%s", p);
}

static int has_safetensors(const char *dir) {
    char p[4096];
    qt_path_join(p, sizeof p, dir, "model.safetensors");
    if (qt_path_exists(p)) return 1;
    qt_path_join(p, sizeof p, dir, "model.safetensors.index.json");
    if (qt_path_exists(p)) return 1;
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *e;
    int found = 0;
    while ((e = readdir(d)) && !found) {
        size_t n = strlen(e->d_name);
        found = n > 12 && !strcmp(e->d_name + n - 12, ".safetensors");
    }
    closedir(d);
    return found;
}

static int64_t file_size(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 ? (int64_t)st.st_size : -1;
}

/* A DeepSpeed number that may be "auto" or absent: 1 and *v when a number. */
static int ds_num(const cJSON *o, const char *k, double *v) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, k);
    if (cJSON_IsNumber(it)) {
        *v = it->valuedouble;
        return 1;
    }
    return 0;
}

/* Pre-tokenized data ({"input_ids": ...}, format "tokens", or "auto" with such a
 * first line) trains without a tokenizer. */
static int needs_tokenizer(const char *dir, const cJSON *data) {
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(data, "format");
    const cJSON *tr = cJSON_GetObjectItemCaseSensitive(data, "train");
    if (cJSON_IsString(fmt) && !strcmp(fmt->valuestring, "tokens")) return 0;
    if (cJSON_IsString(fmt) && strcmp(fmt->valuestring, "auto")) return 1;
    if (cJSON_IsArray(tr)) tr = tr->child; /* a list of files: the first one's format */
    if (!cJSON_IsString(tr)) return 1;
    char p[4096], line[65536];
    job_path(dir, tr->valuestring, p, sizeof p);
    FILE *f = qt_fopen_regular(p, "the data file"); /* a FIFO would block here; the data check names it */
    if (!f) {
        qt_error_clear();
        return 1;
    }
    int need = 1;
    if (fgets(line, sizeof line, f)) {
        cJSON *j = cJSON_Parse(line);
        need = !cJSON_GetObjectItemCaseSensitive(j, "input_ids");
        cJSON_Delete(j);
    }
    fclose(f);
    return need;
}

static void check_model(doc_ctx *c, const char *dir, const char *model, int need_tok, qt_config *cfg,
                        int *have_cfg) {
    char p[4096];
    job_path(dir, model, p, sizeof p);
    *have_cfg = 0;
    if (!qt_is_dir(p)) {
        problem(c, "%s: \"model\" names %s, which is not a folder; point it at a Hugging Face model folder "
                   "(config.json, *.safetensors, tokenizer.json)", c->where, p);
        return;
    }
    if (qt_config_load(p, cfg) != QT_OK) problem(c, "%s: \"model\": %s", c->where, qt_error_message());
    else *have_cfg = 1;
    if (!has_safetensors(p)) {
        problem(c, "%s: \"model\" folder %s holds no *.safetensors weights; convert or download them there",
                c->where, p);
    } else {
        /* what the trainer opens: model.safetensors, or every shard the index
         * lists, each header validated */
        st_file *st = NULL;
        qt_error_clear();
        if (st_open(p, &st) != QT_OK) problem(c, "%s: \"model\": %s", c->where, qt_error_message());
        st_close(st);
    }
    char t[4096];
    if (need_tok && !bpe_folder_file(p, t, sizeof t))
        problem(c, "%s: \"model\" folder %s has no tokenizer.json, which text data needs; copy the base model's tokenizer files "
                   "there", c->where, p);
}

static void check_data(doc_ctx *c, const char *dir, const cJSON *data, int64_t *train_bytes) {
    *train_bytes = 0;
    if (!cJSON_IsObject(data)) return; /* the parser names it */
    static const char *keys[] = {"train", "eval"};
    for (int i = 0; i < 2; i++) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(data, keys[i]);
        for (const cJSON *v = cJSON_IsArray(list) ? list->child : list; v; v = cJSON_IsArray(list) ? v->next : NULL) {
            if (!cJSON_IsString(v)) continue;
            char p[4096];
            job_path(dir, v->valuestring, p, sizeof p);
            int64_t sz = file_size(p);
            struct stat sb;
            if (sz < 0 || access(p, R_OK) != 0)
                problem(c, "%s: data.%s names %s, which cannot be read; check the path (it is relative to the job "
                           "file's folder)", c->where, keys[i], p);
            else if (stat(p, &sb) == 0 && !S_ISREG(sb.st_mode))
                problem(c, "%s: data.%s names %s, which is %s, not a regular file; save the data to a file and name "
                           "that", c->where, keys[i], p, qt_file_kind((unsigned)sb.st_mode));
            else if (sz == 0)
                problem(c, "%s: data.%s file %s is empty; it needs one JSON example per line", c->where, keys[i], p);
            else if (i == 0)
                *train_bytes += sz;
        }
    }
    double T;
    if (ds_num(data, "seq_len", &T) && (!(T >= 2 && T <= 1e7) || T != floor(T)))
        problem(c, "%s: data.seq_len must be a whole number >= 2 (got %g)", c->where, T);
}

/* Every line of a data file as the trainer reads it (format, keys, the
 * tokenizer, ids in the vocabulary), streamed; stops at the first bad line,
 * named FILE:LINE. */
static void check_data_lines(doc_ctx *c, const char *path, const char *key, dl_format fmt, int mask_prompt,
                             const bpe_tokenizer *tok, int32_t vocab) {
    dl_lines r;
    qt_error_clear();
    dl_encode_ctx ctx = {.tok = tok, .mask_prompt = mask_prompt, .vocab_limit = vocab};
    if (dl_source_is_array(path)) { /* one JSON array: read whole, as a run reads it */
        dl_source_opts so = {.path = path, .no_cache = 1, .format = fmt, .enc = ctx, .n_threads = 1};
        dl_source src;
        const int level = qt_log_level();
        qt_log_set_level(QT_LOG_ERROR);
        int rc = dl_source_open(&so, &src);
        qt_log_set_level(level);
        if (rc != QT_OK) {
            problem(c, "%s: data.%s: %s", c->where, key, qt_error_message());
            return;
        }
        fprintf(c->f, "data       %s: %llu example%s read as %s (a JSON array)\n", path,
                (unsigned long long)src.n_examples, src.n_examples == 1 ? "" : "s", dl_format_name(src.format));
        dl_source_close(&src);
        return;
    }
    if (dl_lines_open(&r, path, 0) != QT_OK) return; /* named by check_data */
    dl_tokbuf tb = {0};
    char *line;
    size_t len;
    long long n = 0;
    int got, bad = 0;
    /* the dropped-key warnings are train's to give; here only what stops it */
    const int level = qt_log_level();
    qt_log_set_level(QT_LOG_ERROR);
    while (!bad && (got = dl_lines_next(&r, &line, &len)) != 0) {
        if (got < 0) { bad = 1; break; }
        if (dl_line_blank(line, len)) continue;
        tb.n = 0;
        bad = dl_encode_line_in_place(&ctx, path, (long long)r.line_no, line, len, &fmt, &tb) != QT_OK;
        n += !bad;
    }
    qt_log_set_level(level);
    if (bad) problem(c, "%s: data.%s: %s", c->where, key, qt_error_message());
    else fprintf(c->f, "data       %s: %lld example%s read as %s\n", path, n, n == 1 ? "" : "s", dl_format_name(fmt));
    if (!bad && n && tok && !strcmp(key, "train")) { /* the first example as training sees it, as the run prints it */
        char *ex = NULL;
        if (dl_preview_first(tok, path, dl_format_name(fmt), mask_prompt, 4000, &ex) == QT_OK)
            fprintf(c->f, "example    the first training example (labelled text between [[ and ]]):\n%s\n", ex);
        qt_free(ex);
        qt_error_clear();
    }
    dl_tokbuf_free(&tb);
    dl_lines_close(&r);
}

/* Nearest existing folder at or above p (p itself when it exists). */
static void existing_parent(const char *p, char *out, size_t cap) {
    snprintf(out, cap, "%s", p);
    char up[4096];
    while (!qt_is_dir(out)) {
        qt_path_dirname(up, sizeof up, out);
        if (!strcmp(up, out) || strlen(up) >= cap) break;
        memcpy(out, up, strlen(up) + 1);
    }
}

/* qt_ds_config_problems' sink: each DeepSpeed section's problem in the parser's own sentence. */
static void ds_problem(void *ctx, const char *sentence) { problem((doc_ctx *)ctx, "%s", sentence); }

/* What the parsed DeepSpeed config asks of this machine: bf16 needs AVX512_BF16, as model/precision.c
 * refuses it otherwise (unless QTUNE_BF16_EMULATE=1). */
static void check_precision_here(doc_ctx *c, const qt_ds_config *dc) {
    const char *emu = getenv("QTUNE_BF16_EMULATE");
    if (dc->bf16 && !__builtin_cpu_supports("avx512bf16") && !(emu && !strcmp(emu, "1")))
        problem(c, "%s: deepspeed enables bf16 but this CPU has no AVX512_BF16, so qtune train stops; use fp16 "
                   "or fp32, or a machine with AVX512_BF16", c->where);
}

static const cJSON *load_deepspeed(doc_ctx *c, const char *dir, const cJSON *root, cJSON **owned) {
    *owned = NULL;
    const cJSON *ds = cJSON_GetObjectItemCaseSensitive(root, "deepspeed");
    if (!ds || cJSON_IsNull(ds)) return NULL;
    if (cJSON_IsObject(ds)) return ds;
    if (!cJSON_IsString(ds)) return NULL; /* the parser names it */
    char p[4096];
    job_path(dir, ds->valuestring, p, sizeof p);
    char *text = NULL;
    size_t len;
    if (qt_read_file(p, 64 << 20, &text, &len) != QT_OK) {
        problem(c, "%s: \"deepspeed\" names %s, which cannot be read; check the path", c->where, p);
        return NULL;
    }
    *owned = cJSON_ParseWithLength(text, len);
    qt_free(text);
    if (!cJSON_IsObject(*owned)) {
        problem(c, "%s: the DeepSpeed config %s is not a JSON object; fix its syntax", c->where, p);
        cJSON_Delete(*owned);
        *owned = NULL;
    }
    return *owned;
}

/* The job's plan (`qtune plan` with the run's setup) against this host's memory: 1 and *p when it plans. */
static int check_memory(doc_ctx *c, const qt_config *cfg, const qt_plan_opts *o, int ranks, qt_plan *p) {
    if (qt_plan_compute(cfg, o, p) != QT_OK) {
        problem(c, "%s: %s", c->where, qt_error_message());
        return 0;
    }
    /* Without a GPU every rank's "device" memory is this host's. */
    const uint64_t need = (qt_cuda_driver_gpu_count() > 0 ? 0 : p->dev.total * (uint64_t)ranks) + p->host_total;
    const int64_t avail = qt_meminfo_kib("MemAvailable");
    fprintf(c->f, "plan       %.2f GiB per rank (weights %.2f, grads %.2f, optimizer %.2f, activations %.2f); host "
                  "%.2f GiB\n",
            (double)p->dev.total / GIB, (double)p->dev.weights / GIB, (double)p->dev.grads / GIB,
            (double)(p->dev.optim + p->dev.master) / GIB, (double)p->dev.activations / GIB,
            (double)p->host_total / GIB);
    if (avail > 0 && (double)need > (double)avail * 1024)
        problem(c, "%s: the job needs about %.2f GiB of host memory (`qtune plan` with its settings) but %.2f GiB "
                   "is available; turn on train.gradient_checkpointing, lower the micro-batch or seq_len, or use LoRA",
                c->where, (double)need / GIB, (double)avail * 1024 / GIB);
    return 1;
}

/* The disk the run writes to: the token cache (dataset_bytes of training text) and output_dir, whose
 * checkpoints the plan p sizes (NULL: the job did not load, so only whether a file can be created there). */
static void check_disk(doc_ctx *c, const char *dir, const cJSON *root, uint64_t dataset_bytes, const qt_plan *p) {
    /* the token cache: 4 bytes a token, about 4/3 of the text's bytes at
     * ~3 bytes a token; by default it sits next to the data */
    const cJSON *data = cJSON_GetObjectItemCaseSensitive(root, "data");
    const cJSON *cd = cJSON_GetObjectItemCaseSensitive(data, "cache_dir");
    const cJSON *tr = cJSON_GetObjectItemCaseSensitive(data, "train");
    if (cJSON_IsArray(tr)) tr = tr->child; /* a list of files: the cache of the first one's folder */
    if (dataset_bytes && (cJSON_IsString(cd) || cJSON_IsString(tr))) {
        char where[4096], base[4096];
        if (cJSON_IsString(cd)) job_path(dir, cd->valuestring, where, sizeof where);
        else {
            char t[4096];
            job_path(dir, tr->valuestring, t, sizeof t);
            qt_path_dirname(where, sizeof where, t);
        }
        existing_parent(where, base, sizeof base);
        const int64_t fr = qt_free_disk_bytes(base);
        const double need = (double)dataset_bytes * 4.0 / 3.0;
        fprintf(c->f, "cache      token cache needs about %.3f GiB; %.1f GiB free in %s\n", need / GIB,
                (double)fr / GIB, base);
        if (fr >= 0 && (double)fr < need)
            problem(c, "%s: data.cache_dir %s: %.3f GiB free but the token cache needs about %.3f GiB; free space "
                       "or point data.cache_dir at a larger local disk", c->where, where, (double)fr / GIB,
                    need / GIB);
    }
    const cJSON *od = cJSON_GetObjectItemCaseSensitive(root, "output_dir");
    if (cJSON_IsString(od)) {
        char out[4096], base[4096];
        job_path(dir, od->valuestring, out, sizeof out);
        existing_parent(out, base, sizeof base);
        char probe[4200];
        snprintf(probe, sizeof probe, "%s/.qtune_doctor_XXXXXX", base);
        int fd = mkstemp(probe); /* access(W_OK) says yes to root on a read-only mount */
        if (fd < 0)
            problem(c, "%s: output_dir %s cannot be created or written (a file cannot be created in %s: %s)",
                    c->where, out, base, strerror(errno));
        else {
            close(fd);
            unlink(probe);
        }
        if (!p) return;
        const int64_t fr = qt_free_disk_bytes(base);
        /* a checkpoint being written next to the last, and final/ unless it links the last one's model */
        const uint64_t fin = p->final_linked ? 0 : p->final_bytes, disk = 2 * p->ckpt_bytes + fin;
        fprintf(c->f, "disk       output needs about %.2f GiB (two checkpoints of %.2f GiB + final %.2f GiB%s); %.1f "
                      "GiB free in %s\n",
                (double)disk / GIB, (double)p->ckpt_bytes / GIB, (double)p->final_bytes / GIB,
                p->final_linked ? ", a hard link to the last checkpoint's model" : "", (double)fr / GIB, base);
        if (fr >= 0 && (uint64_t)fr < disk)
            problem(c, "%s: output_dir %s: %.2f GiB free but checkpoints need about %.2f GiB; free space or set "
                       "train.save_total_limit", c->where, out, (double)fr / GIB, (double)disk / GIB);
    }
}

/* The job's "quantization" (QLoRA), as the run loads the model: one line
 * saying what is 4-bit, and what the run's setup refuses (a 4-bit compute
 * dtype other than the run's). */
static void check_quantization(doc_ctx *c, const qt_run_setup *s) {
    const qt_job *job = s->job;
    const qt_job_quant *q = &job->quant;
    if (!q->load_in_4bit) return;
    char skip[160] = "";
    if (q->skip) {
        size_t k = (size_t)snprintf(skip, sizeof skip, ", 16-bit:");
        static const unsigned bits[] = {QT_LORA_Q, QT_LORA_K, QT_LORA_V, QT_LORA_O, QT_LORA_GATE, QT_LORA_UP,
                                        QT_LORA_DOWN};
        static const char *const names[] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"};
        for (int i = 0; i < 7 && k < sizeof skip; i++)
            if (q->skip & bits[i]) k += (size_t)snprintf(skip + k, sizeof skip - k, " %s", names[i]);
    }
    fprintf(c->f, "quant      the base's layer linears in 4 bits as they load (%s%s%s); embedding, lm_head and "
                  "norms 16-bit; compute %s\n",
            qt_q4_type_name((qt_q4_type)q->type), q->double_quant ? ", double-quantized" : "", skip,
            qt_dtype_name(s->cfg.compute));
    if (job->lora.enabled && zero_partitions_params(s->cfg.zero.stage, s->world)) return; /* named below */
    qt_model_opts mo;
    if (qt_run_setup_model_opts(s, &mo) != QT_OK) problem(c, "%s", qt_error_message());
}

int qt_doctor_check_job(FILE *f, const char *path, const char *const *sets, int n_sets, int ranks, int strict) {
    doc_ctx c = {f, path, 0};
    fprintf(f, "job        %s\n", path);
    char *text = NULL;
    size_t len = 0;
    if (qt_read_file(path, 64 << 20, &text, &len) != QT_OK) {
        problem(&c, "%s", qt_error_message());
        return c.n;
    }
    cJSON *root = cJSON_ParseWithLength(text, len);
    qt_free(text);
    if (!cJSON_IsObject(root)) {
        /* the parser's message names the line */
        qt_job job;
        if (qt_job_load(path, NULL, 0, &job) == QT_OK) qt_job_free(&job);
        problem(&c, "%s", qt_error_code() ? qt_error_message() : "the job file is not one JSON object");
        cJSON_Delete(root);
        return c.n;
    }
    /* the job parser: structure and types (it stops at the first problem);
     * what it read (overrides applied, deepspeed and lora files inlined) is
     * what the rest checks */
    qt_job job;
    int have_job = 0; /* the job as the run reads it: its setup (run_setup.h) gives the plan below */
    qt_error_clear();
    if (qt_job_load_ex(path, sets, n_sets, strict, &job) == QT_OK) {
        have_job = 1;
        /* the device as the run would resolve it here: "cuda" with no GPU stops the run */
        char where[4200];
        qt_device dev;
        snprintf(where, sizeof where, "%s: \"device\":", path);
        if (qt_device_resolve(job.device, where, &dev) != QT_OK) problem(&c, "%s", qt_error_message());
        else {
            char label[320];
            qt_device_label(&dev, omp_get_max_threads(), label, sizeof label);
            fprintf(f, "  device: %s%s%s\n", label, dev.note[0] ? "; " : "", dev.note);
        }
        cJSON *r = cJSON_Duplicate(job.root, 1);
        if (r) {
            cJSON_Delete(root);
            root = r;
        }
    } else {
        problem(&c, "%s", qt_error_message());
        for (int i = 0; i < n_sets; i++) qt_job_apply_set(root, sets[i]); /* best effort: named above */
        qt_error_clear();
    }

    char dir[4096];
    qt_path_dirname(dir, sizeof dir, path);
    qt_config cfg;
    int have_cfg = 0;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    const cJSON *data = cJSON_GetObjectItemCaseSensitive(root, "data");
    if (cJSON_IsString(model))
        check_model(&c, dir, model->valuestring, needs_tokenizer(dir, data), &cfg, &have_cfg);
    int64_t train_bytes = 0;
    check_data(&c, dir, data, &train_bytes);

    /* What the run decides (the DeepSpeed settings for `ranks` ranks, precision, ZeRO, the LoRA selection,
     * quantization, the plan) is read from its own setup (run_setup.h), never re-derived here. A job the parser
     * stops on has no setup: its DeepSpeed section is still parsed as the run parses it, every section's
     * problem named at once, and it gets no plan until it loads. */
    char ds_where[4200];
    snprintf(ds_where, sizeof ds_where, "%s: deepspeed", path);
    cJSON *ds_owned = NULL;
    qt_run_setup s;
    qt_ds_config dc;
    int have_setup = 0, have_ds = 0;
    qt_error_clear();
    if (have_job) {
        /* the job's DeepSpeed section passed the parser's checks; what needs the world size (the batch
         * arithmetic) is the setup's to refuse */
        if (qt_run_setup_open(&s, &job, ranks, 0) == QT_OK) {
            have_setup = have_ds = 1, dc = s.ds;
        } else { /* the setup stops at the first: every one, in the same words */
            qt_error_clear();
            qt_ds_config_problems(job.deepspeed, job.deepspeed_path ? job.deepspeed_path : ds_where, ranks, &dc,
                                  ds_problem, &c);
            have_ds = 1;
        }
    } else {
        const cJSON *ds = load_deepspeed(&c, dir, root, &ds_owned);
        if (ds) {
            qt_ds_config_problems(ds, ds_where, ranks, &dc, ds_problem, &c);
            have_ds = 1;
        }
    }
    if (have_ds) {
        check_precision_here(&c, &dc);
        if (dc.precision_auto_off[0])
            fprintf(f, "  warning: %s: %s.enabled is \"auto\", which qtune resolves to false: the job trains in "
                       "fp32, not %s; set %s.enabled to true (or false to mean fp32)\n",
                    ds_where, dc.precision_auto_off, dc.precision_auto_off, dc.precision_auto_off);
    }
    /* the LoRA selection as the run resolves it against the model's layout: target names (Qwen2 names on an
     * original Qwen model), modules_to_save and layers_to_transform */
    int have_lora = 0;
    if (have_job && have_cfg) {
        qt_error_clear();
        if (qt_run_setup_lora(&s, 0) == QT_OK) have_lora = 1;
        else problem(&c, "%s", qt_error_message());
    }
    /* every data line, as the trainer will read it */
    if (cJSON_IsObject(data) && cJSON_IsString(model)) {
        char mp[4096], tp[4096];
        job_path(dir, model->valuestring, mp, sizeof mp);
        bpe_tokenizer *tok = NULL;
        if (bpe_folder_file(mp, tp, sizeof tp) && /* tokenizer.json, or qwen.tiktoken */
            qt_error_oom_advice(bpe_load(tp, &tok), QT_TOKENIZER_OOM_ADVICE) != QT_OK)
            problem(&c, "%s: \"model\": %s", path, qt_error_message());
        if (tok) {
            char desc[512];
            chat_template_describe(tok, desc, sizeof desc);
            fprintf(c.f, "template   %s\n", desc);
        }
        const cJSON *fj = cJSON_GetObjectItemCaseSensitive(data, "format");
        const cJSON *mj = cJSON_GetObjectItemCaseSensitive(data, "mask_prompt");
        dl_format fmt = DL_FORMAT_AUTO;
        if (cJSON_IsString(fj) && dl_format_parse(fj->valuestring, &fmt) != QT_OK) fmt = DL_FORMAT_AUTO;
        static const char *const keys[] = {"train", "eval"};
        for (int i = 0; i < 2; i++) {
            const cJSON *list = cJSON_GetObjectItemCaseSensitive(data, keys[i]);
            for (const cJSON *v = cJSON_IsArray(list) ? list->child : list; v; v = cJSON_IsArray(list) ? v->next : NULL) {
                if (!cJSON_IsString(v)) continue;
                char dp[4096];
                job_path(dir, v->valuestring, dp, sizeof dp);
                /* eval reads every assistant turn's labels as train does */
                check_data_lines(&c, dp, keys[i], fmt, !cJSON_IsFalse(mj), tok,
                                 have_cfg ? (int32_t)cfg.vocab_size : 0);
            }
        }
        bpe_free(tok);
        qt_error_clear();
    }
    /* what the run trains, from its own setup: the plan below is `qtune plan JOB.json`'s, the quantization and
     * a preference objective's pairs included */
    qt_plan plan;
    int planned = 0, disk = have_cfg;
    if (have_setup && have_lora) {
        qt_plan_opts o;
        qt_plan_opts_default(&o);
        qt_run_setup_plan_opts(&s, &o);
        o.dataset_bytes = (uint64_t)train_bytes;
        check_quantization(&c, &s);
        if (o.seq_len > qt_config_max_positions(&cfg) && cfg.max_position_embeddings > 0)
            problem(&c, "%s: data.seq_len %d is longer than the model's %s %d; lower it", path, o.seq_len,
                    qt_config_max_positions(&cfg) < cfg.max_position_embeddings ? "seq_length" : "max_position_embeddings",
                    qt_config_max_positions(&cfg));
        if (job.lora.enabled && zero_partitions_params(s.cfg.zero.stage, ranks) && (job.quant.load_in_4bit || cfg.prequant4)) {
            problem(&c, "%s: ZeRO stage 3 does not partition a 4-bit (QLoRA) base; use zero_optimization.stage 2",
                    path);
            o.zero = 2, o.offload_param = 0; /* plan the rest as the stage that runs */
        }
        disk = planned = check_memory(&c, &cfg, &o, ranks, &plan);
    }
    if (disk) check_disk(&c, dir, root, (uint64_t)train_bytes, planned ? &plan : NULL);
    cJSON_Delete(ds_owned);
    cJSON_Delete(root);
    if (have_job) qt_job_free(&job);
    if (c.n == 0) fprintf(f, "  ok: no problems found\n");
    else fprintf(f, "  %d problem%s found\n", c.n, c.n == 1 ? "" : "s");
    return c.n;
}
