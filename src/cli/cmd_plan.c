/* qtune plan: the memory and hardware plan for a model, a strategy and a
 * device count (src/train/plan_report.h does the sums; docs/plan.md). */
#include "backend/backend.h"
#include "backend/device.h"
#include "cli/cli.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "io/hf_config.h"
#include "io/peft.h"
#include "model/lora_io.h"
#include "model/model.h"
#include "text/tokenizer.h"
#include "train/job.h"
#include "train/plan_card.h"
#include "train/plan_report.h"
#include "train/trainer.h"

#include <ctype.h>
#include <dirent.h>
#include <malloc.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <string.h>

static void plan_help(void) {
    printf("usage: qtune plan (--model DIR | --preset NAME | JOB.json [--set key.path=value ...]) [options]\n\n"
           "With a job file the plan is the job's: its model, LoRA or full fine-tuning, r and targets, and\n"
           "its DeepSpeed config (ZeRO stage, offload, precision, micro-batch, resolved for --devices ranks),\n"
           "seq_len and gradient checkpointing; options given beside it override those.\n\n"
           "Per-device memory by category, host memory, checkpoint size, the smallest device\n"
           "count that fits, and a power/host recommendation with a 20%% margin. A total within the plan's\n"
           "5%% error of the card is \"borderline\"; one that does not fit (or only just) names the one setting\n"
           "not already on that makes it fit. Sized by device auto on a machine without a GPU, the plan says\n"
           "so and gives the CUDA card's total too.\n\n"
           "  --model DIR           a Hugging Face model folder (config.json)\n"
           "  --preset NAME         a preset shape (see `qtune init --help`)\n"
           "  --mode lora|full      default full\n"
           "  --zero 0|1|2|3        ZeRO stage (default 0; 3 partitions the weights too)\n"
           "  --devices N           data-parallel ranks (default 1)\n"
           "  --offload cpu|none    Adam m, v in host memory (needs --zero 1|2|3)\n"
           "  --offload-param cpu|none  ZeRO-3: the rank's parameter shard in host memory\n"
           "  --max-reuse-distance E  ZeRO-3: stage3_max_reuse_distance in parameters (default 1e9); below\n"
           "                        what the layers hold the embedding/lm_head buffer is freed between uses\n"
           "  --reduce-bucket-size E, --allgather-bucket-size E\n"
           "                        DeepSpeed's zero_optimization bucket sizes in elements (default 5e8)\n"
           "  --overlap-comm        DeepSpeed's overlap_comm: ZeRO-2 reductions run during the backward\n"
           "  --precision fp32|fp16|bf16  compute dtype (default fp32)\n"
           "  --micro-batch B       default 1\n"
           "  --seq-len T           default 512\n"
           "  --checkpointing       activation recomputation\n"
           "  --quantization nf4|fp4|none  QLoRA (with --mode lora): the layers' linears in 4 bits, 0.5 byte a\n"
           "                        weight plus a float32 absmax per 64 (the job's \"quantization\" key)\n"
           "  --double-quant        bnb_4bit_use_double_quant: the absmax values in 8 bits too\n"
           "  --device-memory GiB   memory of one card (default 32)\n"
           "  --lora-r R            default 8\n"
           "  --lora-targets LIST   comma-separated: q,k,v,o,gate,up,down or PEFT names; all-linear (default q,v;\n"
           "                        the original Qwen's names are c_attn, c_proj, w1, w2)\n"
           "  --modules-to-save LIST  PEFT's modules_to_save trained beside the adapter: embed_tokens (or wte),\n"
           "                        lm_head, comma-separated (their weights, gradients and Adam state count)\n"
           "  --card-watts W        TDP of one card (default 300, a 32 GB card)\n"
           "  --host-watts W        one host without its cards (default 500)\n"
           "  --cards-per-host K    default min(devices, 8)\n"
           "  --dataset-gib G       dataset/token cache held in host memory (default 1)\n"
           "  --strategies          also print the field report's three strategies for this shape\n"
           "  --device D            size workspaces with the descriptor of device D: cpu, cuda (or cuda:N),\n"
           "                        npu (the Atlas 300T A2: no bf16), auto; the device need not be on this\n"
           "                        machine. Default: QTUNE_BACKEND\n"
           "                        when set, else the job's \"device\", else auto (a GPU when one is\n"
           "                        visible here, else the CPU)\n"
           "  --backend NAME        the same by backend name (cpu, guard, cuda)\n"
           "  --json                print one JSON object instead of the table\n");
}

/* --lora-targets against the model's layout, as a run resolves a job's
 * target_modules (qt_lora_targets_from_names): q,k,v,o,gate,up,down stand for
 * q_proj ... down_proj; PEFT names and all-linear as they are (the original
 * Qwen's c_attn, c_proj, w1, w2; its q_proj is refused with the list to
 * write, where it planned nothing). */
static int resolve_targets(const qt_config *cfg, const char *s, unsigned *mask) {
    static const char *const short_names[] = {"q", "k", "v", "o", "gate", "up", "down"};
    char buf[512], names[PEFT_MAX_TARGETS][64];
    const char *list[PEFT_MAX_TARGETS];
    int n = 0;
    if (snprintf(buf, sizeof buf, "%s", s) >= (int)sizeof buf)
        return QT_ERR(QT_EINVAL, "--lora-targets '%.40s...' is too long", s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (n == PEFT_MAX_TARGETS) return QT_ERR(QT_EINVAL, "--lora-targets names more than %d modules", PEFT_MAX_TARGETS);
        snprintf(names[n], sizeof names[n], "%s", tok);
        for (char *c = names[n]; *c; c++) *c = (char)tolower((unsigned char)*c); /* Q_PROJ as q_proj, as before */
        for (size_t i = 0; i < sizeof short_names / sizeof short_names[0]; i++)
            if (!strcmp(names[n], short_names[i])) snprintf(names[n], sizeof names[n], "%s_proj", short_names[i]);
        list[n] = names[n];
        n++;
    }
    return qt_lora_targets_from_names(cfg, list, n, mask, "--lora-targets");
}

/* Sum of the *.safetensors sizes in a model folder (0 when none). */
static uint64_t weights_file_bytes(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    uint64_t sum = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        char p[4096];
        struct stat st;
        if (n > 12 && !strcmp(e->d_name + n - 12, ".safetensors") &&
            qt_path_join(p, sizeof p, dir, e->d_name) == QT_OK && stat(p, &st) == 0)
            sum += (uint64_t)st.st_size;
    }
    closedir(d);
    return sum;
}

/* Bytes the model folder's tokenizer keeps once loaded (every rank's process
 * loads it): measured by loading it, as the heap's growth (mallinfo2: the
 * small blocks and the mmap'd large ones), the loader's transient parse tree
 * freed. 0 when the folder has none or it does not load (a run names why). */
static uint64_t tokenizer_bytes(const char *dir) {
    char path[4096];
    bpe_tokenizer *tok = NULL;
    if (!bpe_folder_file(dir, path, sizeof path)) return 0;
    const struct mallinfo2 before = mallinfo2();
    if (bpe_load(path, &tok) != QT_OK) {
        qt_error_clear();
        return 0;
    }
    const struct mallinfo2 after = mallinfo2();
    bpe_free(tok);
    const size_t b = before.uordblks + before.hblkhd, a = after.uordblks + after.hblkhd;
    return a > b ? (uint64_t)(a - b) : 0;
}

static int parse_int(const char *s, int lo, int hi, int *out) {
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

static int parse_num(const char *s, double *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end || !(v > 0) || v > 1e9) return -1;
    *out = v;
    return 0;
}

int cmd_plan(int argc, char **argv) {
    if (cli_wants_help(argc, argv)) {
        plan_help();
        return QT_EXIT_OK;
    }
    qt_plan_opts o;
    qt_plan_opts_default(&o);
    const char *model = NULL, *preset = NULL, *job_path = NULL, *targets_arg = NULL;
    int json = 0, strategies = 0, backend_given = 0;
    /* a job file first: its settings are the defaults the options override */
    const char **sets = calloc((size_t)argc + 1, sizeof *sets);
    int n_sets = 0, ranks = 1;
    if (!sets) return cli_fail();
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--set") && i + 1 >= argc) {
            free(sets);
            return cli_usage_error("plan", "--set needs a value: --set key.path=value");
        }
        if (!strcmp(argv[i], "--set")) sets[n_sets++] = argv[++i];
        else if (!strcmp(argv[i], "--devices") && i + 1 < argc) parse_int(argv[++i], 1, 4096, &ranks);
        else if (argv[i][0] != '-' && (i == 1 || argv[i - 1][0] != '-' || !strcmp(argv[i - 1], "--checkpointing") ||
                                      !strcmp(argv[i - 1], "--double-quant") ||
                                      !strcmp(argv[i - 1], "--strategies") || !strcmp(argv[i - 1], "--json") ||
                                      !strcmp(argv[i - 1], "--overlap-comm")))
            job_path = argv[i];
    }
    char job_model[4096], job_device[32] = "", job_objective[768] = "";
    if (job_path) {
        qt_job job;
        int rc = qt_job_load(job_path, sets, n_sets, &job); /* on failure job is left empty */
        if (rc == QT_OK) rc = qt_plan_opts_from_job(&job, ranks, &o);
        if (rc == QT_OK) snprintf(job_model, sizeof job_model, "%s", job.model);
        if (rc == QT_OK) snprintf(job_device, sizeof job_device, "%s", job.device);
        if (rc == QT_OK) qt_objective_plan_note(&job.objective, job.lora.enabled, job_objective, sizeof job_objective);
        qt_job_free(&job);
        free(sets);
        if (rc != QT_OK) return cli_fail();
        model = job_model;
    } else {
        free(sets);
        if (n_sets) return cli_usage_error("plan", "--set needs a job file: qtune plan JOB.json --set key.path=value");
    }
    cli_once_list once = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (a == job_path) continue;
        if (!strcmp(a, "--set")) { i++; continue; }
#define NEED_VALUE() CLI_NEED_VALUE(&once, "plan", a, v, i)
        if (!strcmp(a, "--model")) { NEED_VALUE(); model = v; }
        else if (!strcmp(a, "--preset")) { NEED_VALUE(); preset = v; }
        else if (!strcmp(a, "--mode")) {
            NEED_VALUE();
            if (!strcmp(v, "lora")) o.lora = 1;
            else if (!strcmp(v, "full")) o.lora = 0;
            else return cli_usage_error("plan", "--mode must be lora or full, not '%s'", v);
        } else if (!strcmp(a, "--backend")) {
            NEED_VALUE();
            if (!qt_backend_desc_of(v))
                return cli_usage_error("plan", "--backend must name a compiled-in backend (cpu, guard, cuda), not '%s'", v);
            o.backend = v;
            backend_given = 1;
        } else if (!strcmp(a, "--device")) {
            NEED_VALUE();
            if (qt_backend_desc_of(v)) o.backend = v; /* cpu, cuda, and guard as --backend takes it */
            else if (qt_device_check(v, "--device") == QT_OK) o.backend = qt_device_desc_name(v); /* NULL: auto */
            else {
                qt_error_clear();
                return cli_usage_error("plan", "--device must be cpu, cuda, cuda:N, npu, npu:N or auto, not '%s'", v);
            }
            backend_given = 1;
        } else if (!strcmp(a, "--zero")) {
            NEED_VALUE();
            if (parse_int(v, 0, 3, &o.zero)) return cli_usage_error("plan", "--zero must be 0, 1, 2 or 3, not '%s'", v);
        } else if (!strcmp(a, "--devices")) {
            NEED_VALUE();
            if (parse_int(v, 1, 4096, &o.devices))
                return cli_usage_error("plan", "--devices must be a whole number from 1 to 4096, not '%s'", v);
        } else if (!strcmp(a, "--reduce-bucket-size") || !strcmp(a, "--allgather-bucket-size")) {
            NEED_VALUE();
            char *end = NULL;
            double e = strtod(v, &end);
            if (!end || *end || !(e >= 1 && e < 1e15))
                return cli_usage_error("plan", "%s must be a number of elements >= 1, not '%s'", a, v);
            if (a[2] == 'r') o.reduce_bucket = (size_t)e;
            else o.allgather_bucket = (size_t)e;
        } else if (!strcmp(a, "--max-reuse-distance")) {
            NEED_VALUE();
            char *end = NULL;
            double e = strtod(v, &end);
            if (!end || *end || !(e >= 0 && e < 1e15))
                return cli_usage_error("plan", "--max-reuse-distance must be a number of parameters >= 0, not '%s'", v);
            o.reuse_distance = e;
        } else if (!strcmp(a, "--overlap-comm")) {
            o.overlap = 1;
        } else if (!strcmp(a, "--offload-param")) {
            NEED_VALUE();
            if (!strcmp(v, "cpu")) o.offload_param = 1;
            else if (!strcmp(v, "none")) o.offload_param = 0;
            else return cli_usage_error("plan", "--offload-param must be cpu or none, not '%s'", v);
        } else if (!strcmp(a, "--offload")) {
            NEED_VALUE();
            if (!strcmp(v, "cpu")) o.offload = 1;
            else if (!strcmp(v, "none")) o.offload = 0;
            else return cli_usage_error("plan", "--offload must be cpu or none, not '%s'", v);
        } else if (!strcmp(a, "--precision")) {
            NEED_VALUE();
            if (qt_dtype_parse(v, &o.precision) != QT_OK)
                return cli_usage_error("plan", "--precision must be fp32, fp16 or bf16, not '%s'", v);
        } else if (!strcmp(a, "--micro-batch")) {
            NEED_VALUE();
            if (parse_int(v, 1, 1 << 20, &o.micro_batch))
                return cli_usage_error("plan", "--micro-batch must be a whole number from 1 to %d, not '%s'", 1 << 20, v);
        } else if (!strcmp(a, "--seq-len")) {
            NEED_VALUE();
            if (parse_int(v, 1, 1 << 22, &o.seq_len))
                return cli_usage_error("plan", "--seq-len must be a whole number from 1 to %d, not '%s'", 1 << 22, v);
        } else if (!strcmp(a, "--checkpointing")) o.checkpointing = 1;
        else if (!strcmp(a, "--double-quant")) o.quant4_nested = 1;
        else if (!strcmp(a, "--quantization")) {
            NEED_VALUE();
            if (!strcmp(v, "nf4") || !strcmp(v, "fp4")) o.quant4 = 1;
            else if (!strcmp(v, "none")) o.quant4 = 0;
            else return cli_usage_error("plan", "--quantization must be nf4, fp4 or none, not '%s'", v);
        }
        else if (!strcmp(a, "--device-memory")) {
            NEED_VALUE();
            if (parse_num(v, &o.device_gib))
                return cli_usage_error("plan", "--device-memory must be a positive number of GiB, not '%s'", v);
        } else if (!strcmp(a, "--lora-r")) {
            NEED_VALUE();
            if (parse_int(v, 1, 65536, &o.lora_r))
                return cli_usage_error("plan", "--lora-r must be a whole number from 1 to 65536, not '%s'", v);
        } else if (!strcmp(a, "--lora-targets")) {
            NEED_VALUE();
            targets_arg = v; /* resolved against the model's layout below, as a run resolves target_modules */
        } else if (!strcmp(a, "--modules-to-save")) {
            NEED_VALUE();
            char buf[256];
            snprintf(buf, sizeof buf, "%s", v);
            o.lora_save = 0;
            for (char *save, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                if (!strcmp(t, "embed_tokens") || !strcmp(t, "wte")) o.lora_save |= QT_SAVE_EMBED;
                else if (!strcmp(t, "lm_head")) o.lora_save |= QT_SAVE_LM_HEAD;
                else return cli_usage_error("plan", "--modules-to-save names '%s'; qtune trains embed_tokens (wte) and "
                                            "lm_head beside an adapter", t);
            }
        } else if (!strcmp(a, "--card-watts")) {
            NEED_VALUE();
            if (parse_num(v, &o.card_watts)) return cli_usage_error("plan", "--card-watts must be positive, not '%s'", v);
        } else if (!strcmp(a, "--host-watts")) {
            NEED_VALUE();
            if (parse_num(v, &o.host_watts)) return cli_usage_error("plan", "--host-watts must be positive, not '%s'", v);
        } else if (!strcmp(a, "--cards-per-host")) {
            NEED_VALUE();
            if (parse_int(v, 1, 4096, &o.cards_per_host))
                return cli_usage_error("plan", "--cards-per-host must be a whole number from 1 to 4096, not '%s'", v);
        } else if (!strcmp(a, "--dataset-gib")) {
            NEED_VALUE();
            double g;
            if (parse_num(v, &g)) return cli_usage_error("plan", "--dataset-gib must be positive, not '%s'", v);
            o.dataset_bytes = (uint64_t)(g * 1024.0 * 1024.0 * 1024.0);
        } else if (!strcmp(a, "--strategies")) strategies = 1;
        else if (!strcmp(a, "--json")) json = 1;
        else return cli_usage_error("plan", "unknown option '%s'", a);
#undef NEED_VALUE
    }
    if (!model == !preset)
        return cli_usage_error("plan", "give exactly one of a job file, --model DIR or --preset NAME");
    if (o.offload_param && o.zero != 3)
        return cli_usage_error("plan", "--offload-param cpu needs --zero 3 (only stage 3 partitions the weights)");
    if (o.offload && o.zero == 0)
        return cli_usage_error("plan", "--offload cpu needs --zero 1 or 2 (the offloaded state is the sharded optimizer)");

    /* Whose descriptor: the option's; else as a run here would choose:
     * QTUNE_BACKEND (the test hook), the job's "device", auto */
    if (!o.backend) {
        const char *env = getenv("QTUNE_BACKEND");
        qt_device dev;
        if (!backend_given && !(env && *env) && job_device[0]) o.backend = qt_device_desc_name(job_device);
        if (!o.backend && qt_device_resolve("auto", "--device", &dev) != QT_OK) return cli_fail();
        if (!o.backend) {
            o.backend = dev.backend;
            o.backend_auto = !(env && *env); /* what this machine has, not what the job's cards are */
        }
    }
    /* the card the device stands for (the Atlas 300T A2 for npu) may lack bf16: no plan for a run that cannot start */
    const qt_plan_card *card = qt_plan_card_of(o.backend);
    if (card && !card->bf16 && o.precision == QT_BF16)
        return cli_usage_error("plan", "the %s (device \"%s\") has no bf16, so a bf16 run cannot start on it; plan "
                               "fp16 (--precision fp16, with dynamic loss scaling) or fp32", card->name, card->backend);
    qt_config cfg;
    if ((model ? qt_config_load(model, &cfg) : qt_preset(preset, &cfg)) != QT_OK) return cli_fail();
    if (model) o.weights_file_bytes = weights_file_bytes(model);
    if (model) o.tokenizer_bytes = tokenizer_bytes(model);
    if (targets_arg && resolve_targets(&cfg, targets_arg, &o.lora_targets) != QT_OK)
        return cli_usage_error("plan", "%s", qt_error_message());
    qt_plan p;
    if (qt_plan_compute(&cfg, &o, &p) != QT_OK) return cli_fail();
    const char *name = model ? model : preset;
    if (json) {
        char *s = qt_plan_json(name, &cfg, &o, &p);
        if (!s) return cli_fail();
        printf("%s\n", s);
        qt_free(s);
    } else {
        qt_plan_print(stdout, name, &cfg, &o, &p);
        if (job_objective[0]) printf("%s\n", job_objective);
        if (strategies) {
            printf("\n");
            qt_plan_print_strategies(stdout, name, &cfg, &o);
        }
    }
    return QT_EXIT_OK;
}
