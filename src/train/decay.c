/* The weight-decay ranges of the trainable block, from the model's parameter
 * table (decay.h). */
#include "train/decay.h"

#include <stdlib.h>

#include "core/error.h"
#include "core/mem.h"

static int cmp_param_offset(const void *a, const void *b) {
    const qt_range *x = a, *y = b;
    return (x->lo > y->lo) - (x->lo < y->lo);
}

int qt_decay_ranges_from_params(const qt_param *params, int n_params, qt_range **out, int *n_out) {
    *out = NULL;
    *n_out = 0;
    int n = 0;
    for (int i = 0; i < n_params; i++)
        if (params[i].decay && params[i].numel > 0) n++;
    if (n == 0) return QT_OK;
    qt_range *r = qt_malloc((size_t)n * sizeof *r, "weight-decay ranges");
    if (!r) return QT_ENOMEM;
    n = 0;
    for (int i = 0; i < n_params; i++)
        if (params[i].decay && params[i].numel > 0)
            r[n++] = (qt_range){params[i].offset, params[i].offset + params[i].numel};
    qsort(r, (size_t)n, sizeof *r, cmp_param_offset);
    int k = 0;
    for (int i = 1; i < n; i++) {
        if (r[i].lo < r[k].hi) {
            size_t at = r[i].lo;
            qt_free(r);
            return QT_ERR(QT_EINVAL, "parameter table: two parameters overlap at element %zu of the trainable block",
                          at);
        }
        if (r[i].lo == r[k].hi) r[k].hi = r[i].hi;
        else r[++k] = r[i];
    }
    *out = r;
    *n_out = k + 1;
    return QT_OK;
}
