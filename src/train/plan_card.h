/* Cards the plan knows by their device, beside the backend's descriptor
 * (which sizes the workspaces): the field report's Ascend card for "npu".
 * CUDA cards vary, so "cuda" has none and --device-memory says its size. */
#ifndef QT_TRAIN_PLAN_CARD_H
#define QT_TRAIN_PLAN_CARD_H

typedef struct {
    const char *backend;   /* the device it stands for: "npu" */
    const char *name;      /* "Atlas 300T A2" */
    double hbm_gib;        /* memory of one card */
    double fp16_tflops;    /* dense fp16 peak of one card */
    int bf16;              /* 0: the card has no bf16 */
    const char *source;    /* where the figures come from */
} qt_plan_card;

/* The card of backend `name`, or NULL. */
const qt_plan_card *qt_plan_card_of(const char *backend);

#endif
