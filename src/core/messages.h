/* Messages that `qtune doctor` lists in its table of known failures.
 *
 * Each is the exact text (a printf format) that the code prints when the
 * failure happens, so the doctor's table and the program share one string:
 * change the wording here and both follow. Whoever raises one of these must
 * use the constant, never a copy of the text.
 *
 * Owner: tools (plan/doctor/generate). Other modules' failure texts that the
 * table lists live with their owners (loss scaler: src/optim/, collective
 * timeout: src/dist/); the doctor includes those headers. */
#ifndef QT_CORE_MESSAGES_H
#define QT_CORE_MESSAGES_H

/* Out of memory, raised by qt_malloc & co. (src/core/mem.c):
 * args: double MiB, const char *what. */
#define QT_MSG_OOM_FMT                                                                             \
    "could not allocate %.1f MiB for %s; free memory, lower the micro-batch or seq_len, "          \
    "or turn on gradient_checkpointing (see `qtune plan`)"

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
    "use an instruct model as the base, train with lora.modules_to_save embed_tokens/lm_head, "    \
    "or cap the reply with --max-new"

#endif
