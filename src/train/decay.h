/* Which elements of the trainable block get weight decay: the parameters the
 * model marks (its 2-D weight matrices, as the Hugging Face Trainer groups
 * parameters), as the ranges the optimizer takes (optim/adam.h). Here, above
 * both, so the optimizer never sees the model's tensors. */
#ifndef QT_TRAIN_DECAY_H
#define QT_TRAIN_DECAY_H

#include "model/model.h"
#include "optim/adam.h"

/* Decay ranges from the parameter table: every param with decay = 1, sorted
 * by offset, adjacent ones merged. *out is qt_malloc'd (qt_free it); NULL with
 * *n_out = 0 when no parameter decays. QT_EINVAL when two overlap. */
int qt_decay_ranges_from_params(const qt_param *params, int n_params, qt_range **out, int *n_out);

#endif
