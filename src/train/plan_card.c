/* The plan's cards (plan_card.h). */
#include "train/plan_card.h"

#include <string.h>

/* The Atlas 300T A2 as the field report qtune comes from gives it (its
 * Qwen-14B runs on four of them): 32 GB of HBM, taken as 32 GiB like the
 * plan's default card, 140 TFLOP/s in fp16, no bf16. Not measured here: no
 * Ascend card has reached this project. */
static const qt_plan_card cards[] = {
    {"npu", "Atlas 300T A2", 32.0, 140.0, 0, "the field report's figures, not measured"},
};

const qt_plan_card *qt_plan_card_of(const char *backend) {
    for (size_t i = 0; backend && i < sizeof cards / sizeof cards[0]; i++)
        if (!strcmp(cards[i].backend, backend)) return &cards[i];
    return NULL;
}
