/* Numbers in a JSON text that a double cannot hold. cJSON reads them with
 * strtod and drops its ERANGE: 1e-400 becomes 0 and 1e400 becomes infinity
 * without a word, so a config saying lr 1e-400 would train with lr 0. Every
 * reader of a user's JSON config (job file, DeepSpeed file, --set values,
 * adapter_config.json, config.json) runs this on the text cJSON accepted,
 * before reading any field. */
#ifndef QT_CORE_JSON_RANGE_H
#define QT_CORE_JSON_RANGE_H

#include <stddef.h>

/* Checks every number in text[0, len) (JSON that cJSON parsed; text must be
 * NUL-terminated at or after len). Returns QT_OK, or QT_EINVAL with one
 * sentence naming `where` (the file), the key path ("optimizer.params.lr",
 * "betas[1]"), the number as written and what it would have read as.
 * Magnitudes below DBL_MIN (2.2e-308, subnormal or flushed to 0) and above
 * DBL_MAX are refused; an exact zero (0, 0.0, 0e-400) is fine. */
int qt_json_check_range(const char *text, size_t len, const char *where);

/* The error for JSON text that cJSON refused, err its error pointer:
 * QT_EFORMAT with one sentence naming `where` (the file), the line and, for
 * NaN or Infinity (what Python's json.dump writes for a float that is not
 * finite; no JSON reader takes it), the key path ("rope_scaling.factor").
 * `hint` ends the sentence: what to do. */
int qt_json_parse_error(const char *text, const char *err, const char *where, const char *hint);

/* A key that appears twice in one object, anywhere in the tree, is refused
 * with one sentence naming `where` and the key path ("train.lr"): cJSON keeps
 * the first, Python's json the last. The job file and the DeepSpeed file run it. */
struct cJSON;
int qt_json_check_duplicate_keys(const struct cJSON *root, const char *where);

/* Whether JSON text s[0, len) holds a \u0000 escape (a backslash after an
 * even number of backslashes, then u0000). cJSON decodes it to a NUL byte,
 * where the C string of that value then ends: the rest of the string would be
 * dropped unseen, so readers of text (prompts, training lines) refuse it. */
int qt_json_has_nul_escape(const char *s, size_t len);

#endif
