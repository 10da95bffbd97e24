/* Messages that `qtune doctor` lists in its table of known failures.
 *
 * Each is the exact text (a printf format) that the code prints when the
 * failure happens, so the doctor's table and the program share one string:
 * change the wording here and both follow. Whoever raises one of these must
 * use the constant, never a copy of the text.
 *
 * Owner: tools (plan/doctor/generate). A failure text that lives with its
 * owner instead is listed by the doctor from the owner's header: the fp16
 * loss-scale floor is QT_MSG_LOSS_SCALE_FLOOR_FMT in src/optim/loss_scaler.h. */
#ifndef QT_CORE_MESSAGES_H
#define QT_CORE_MESSAGES_H

/* Out of memory, raised by qt_malloc & co. (src/core/mem.c):
 * args: double MiB, const char *what. */
#define QT_MSG_OOM_FMT                                                                             \
    "could not allocate %.1f MiB for %s; free memory, lower the micro-batch or seq_len, "          \
    "turn on gradient_checkpointing, or shard with ZeRO stage 2 (see `qtune plan`)"

/* Speed collapse: the training step waited on the data loader. Printed as a
 * warning by the trainer/loader. args: double percent of wall time the step
 * waited for a batch, int steps measured over. */
#define QT_MSG_LOADER_STARVED_FMT                                                                  \
    "the training step waited for data %.0f%% of the time over the last %d steps; "               \
    "raise data.num_workers or data.prefetch, set data.cache_dir to a local disk, "                \
    "or check that OMP_NUM_THREADS leaves cores for the loader"

/* A LoRA/base model that never stops generating in chat mode: ChatML's
 * special tokens were never trained in the base. Printed by `qtune generate
 * --chat`. args: const char *token ("<|im_end|>"), const char *reason. */
#define QT_MSG_CHAT_UNTRAINED_FMT                                                                  \
    "%s looks untrained in this model (%s), so chat replies may never stop; "                     \
    "use the instruct model as the base (or train embed_tokens and lm_head too: lora.modules_to_save " \
    "[\"embed_tokens\", \"lm_head\"], or full fine-tuning), " \
    "and cap the reply with --max-new"

/* Collective timeout (src/dist/): a rank died or stalled. Printed by every
 * surviving rank after "qtune: error: ". args: int this rank, const char
 * *collective, double timeout seconds, const char *which ranks stopped. */
#define QT_MSG_DIST_TIMEOUT_FMT                                                                    \
    "rank %d: collective %s did not complete within %g s; %s. Check that every rank is alive, "   \
    "the network between hosts, and raise QTUNE_DIST_TIMEOUT if steps are just slow"

/* LoRA target_modules with Qwen2 names on an original Qwen (QWenLMHeadModel)
 * model, where PEFT stops with "Target modules {...} not found in the base
 * model". Raised before anything is loaded (model/lora_io.c
 * qt_lora_targets_for: train, eval, generate, merge; `qtune doctor` shows it
 * for a job file). args: const char *where, const char *the names asked for,
 * const char *the list to write (JSON). */
#define QT_MSG_QWEN1_TARGETS_FMT                                                                   \
    "%s: target_modules names %s, which do not exist in an original Qwen (QWenLMHeadModel) model: " \
    "it has one fused c_attn (q, k and v together), c_proj (attention and MLP output), w1 and w2; "  \
    "write \"target_modules\": %s"

#endif
