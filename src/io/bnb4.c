/* bnb4_read: a bitsandbytes 4-bit weight out of a transformers folder into
 * the one block (core/quant4.h) that the backends, merge and export read. */
#include "io/bnb4.h"

#include "core/error.h"
#include "core/mem.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>

static const st_tensor *quant_state(st_file *st, const char *name, const char **type) {
    char key[320];
    for (int k = 0; k < 2; k++) {
        snprintf(key, sizeof key, "%s.quant_state.bitsandbytes__%s", name, k ? "fp4" : "nf4");
        const st_tensor *qs = st_find(st, key);
        if (qs) {
            *type = k ? "fp4" : "nf4";
            return qs;
        }
    }
    return NULL;
}

int bnb4_is_weight(st_file *st, const st_tensor *t) {
    const char *type;
    return t->dtype == QT_U8 && quant_state(st, t->name, &type) != NULL;
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n > k && !strcmp(s + n - k, suffix);
}

int bnb4_is_part(const char *name) {
    return ends_with(name, ".absmax") || ends_with(name, ".quant_map") || ends_with(name, ".nested_absmax") ||
           ends_with(name, ".nested_quant_map") || strstr(name, ".quant_state.") != NULL;
}

/* One component of a pre-quantized weight, NAME.SUFFIX: present, of dtype dt
 * and n elements, else a sentence naming it. */
static int part(st_file *st, const char *dir, const char *name, const char *suffix, qt_dtype dt, size_t n,
                const st_tensor **out) {
    char full[320];
    snprintf(full, sizeof full, "%s.%s", name, suffix);
    const st_tensor *t = st_find(st, full);
    if (!t)
        return QT_ERR(QT_EFORMAT, "%s: the 4-bit weight %s has no %s; the folder is incomplete, re-download or "
                                  "re-save it", dir, name, full);
    if (t->dtype != dt || t->numel != n)
        return QT_ERR(QT_EFORMAT, "%s: %s is %s with %zu elements, but %s (%s) needs %s with %zu; the folder does not "
                                  "match its quant_state, re-save it", dir, full, qt_dtype_name(t->dtype), t->numel,
                      name, suffix, qt_dtype_name(dt), n);
    *out = t;
    return QT_OK;
}

int bnb4_read(st_file *st, const char *dir, const st_tensor *t, int64_t d0, int64_t d1, qt_q4_weight **out,
              size_t *bytes) {
    const char *name = t->name, *type = NULL;
    char json[1024];
    *out = NULL;
    const st_tensor *qs = quant_state(st, name, &type);
    if (!qs || qs->dtype != QT_U8 || qs->numel >= sizeof json)
        return QT_ERR(QT_EFORMAT, "%s: %s is stored as bytes but has no quant_state.bitsandbytes__nf4 or __fp4 "
                                  "beside it; qtune reads bitsandbytes 4-bit weights in transformers' layout only",
                      dir, name);
    memcpy(json, qs->data, qs->numel);
    json[qs->numel] = 0;
    cJSON *j = cJSON_Parse(json);
    const cJSON *qt = cJSON_GetObjectItemCaseSensitive(j, "quant_type"), *bs = cJSON_GetObjectItemCaseSensitive(j, "blocksize"),
                *dt = cJSON_GetObjectItemCaseSensitive(j, "dtype"), *sh = cJSON_GetObjectItemCaseSensitive(j, "shape"),
                *nb = cJSON_GetObjectItemCaseSensitive(j, "nested_blocksize"),
                *off = cJSON_GetObjectItemCaseSensitive(j, "nested_offset");
    qt_dtype sdt = QT_F32;
    int ok = j && cJSON_IsString(qt) && !strcmp(qt->valuestring, type) && cJSON_IsNumber(bs) && cJSON_IsString(dt) &&
             qt_dtype_parse(dt->valuestring, &sdt) == QT_OK && cJSON_IsArray(sh) && cJSON_GetArraySize(sh) == 2 &&
             cJSON_IsNumber(cJSON_GetArrayItem(sh, 0)) && cJSON_IsNumber(cJSON_GetArrayItem(sh, 1));
    if (ok && d0 < 0) { /* the shape as the quant_state gives it (merge, export) */
        const double s0 = cJSON_GetArrayItem(sh, 0)->valuedouble, s1 = cJSON_GetArrayItem(sh, 1)->valuedouble;
        ok = s0 >= 1 && s1 >= 1 && s0 < 1e9 && s1 < 1e9 && s0 == (int64_t)s0 && s1 == (int64_t)s1;
        d0 = ok ? (int64_t)s0 : 0, d1 = ok ? (int64_t)s1 : 0;
    }
    ok = ok && cJSON_GetArrayItem(sh, 0)->valuedouble == (double)d0 && cJSON_GetArrayItem(sh, 1)->valuedouble == (double)d1;
    const int blocksize = ok ? (int)bs->valuedouble : 0, nested = nb != NULL;
    ok = ok && blocksize >= 16 && blocksize <= 4096 && !(blocksize & (blocksize - 1)) &&
         (!nested || (cJSON_IsNumber(nb) && nb->valuedouble == QT_Q4_BLOCK2 && cJSON_IsNumber(off)));
    const float offset = ok && nested ? (float)off->valuedouble : 0.0f;
    if (!ok) qt_error_clear();
    cJSON_Delete(j);
    if (!ok)
        return QT_ERR(QT_EFORMAT, "%s: %s's quant_state (%s.quant_state.bitsandbytes__%s) is not a %s weight of shape "
                                  "[%lld, %lld] with a power-of-two blocksize (and nested_blocksize 256 with a "
                                  "nested_offset); the folder lies about its tensors, re-save it", dir, name, name,
                      type, type, (long long)d0, (long long)d1);
    const size_t n = (size_t)d0 * (size_t)d1, nbk = (n + (size_t)blocksize - 1) / (size_t)blocksize;
    const st_tensor *am, *qm, *nam = NULL, *nqm = NULL;
    if (t->numel != (n + 1) / 2)
        return QT_ERR(QT_EFORMAT, "%s: %s holds %zu bytes of 4-bit codes but its shape [%lld, %lld] needs %zu; the "
                                  "folder lies about its tensors, re-save it", dir, name, t->numel, (long long)d0,
                      (long long)d1, (n + 1) / 2);
    QT_TRY(part(st, dir, name, "absmax", nested ? QT_U8 : QT_F32, nbk, &am));
    QT_TRY(part(st, dir, name, "quant_map", QT_F32, 16, &qm));
    if (nested) {
        QT_TRY(part(st, dir, name, "nested_absmax", QT_F32, (nbk + QT_Q4_BLOCK2 - 1) / QT_Q4_BLOCK2, &nam));
        QT_TRY(part(st, dir, name, "nested_quant_map", QT_F32, 256, &nqm));
    }
    const size_t size = qt_q4_bytes((uint64_t)d0, (uint64_t)d1, blocksize, nested);
    qt_q4_weight *w = qt_calloc(1, size, "4-bit weight");
    if (!w) return QT_ENOMEM;
    qt_q4_init(w, !strcmp(type, "fp4") ? QT_Q4_FP4 : QT_Q4_NF4, sdt, (uint64_t)d0, (uint64_t)d1, blocksize, nested);
    memcpy(qt_q4_packed(w), t->data, t->numel);
    memcpy(qt_q4_absmax(w), am->data, am->nbytes);
    memcpy(w->code, qm->data, sizeof w->code); /* the folder's own maps: bitsandbytes reads them so */
    if (nested) {
        memcpy(qt_q4_absmax2(w), nam->data, nam->nbytes);
        memcpy(w->code2, nqm->data, sizeof w->code2);
        w->offset = offset;
    }
    *out = w;
    *bytes = size;
    return QT_OK;
}
