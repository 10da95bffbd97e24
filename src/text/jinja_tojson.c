/* JSON as a chat template's tojson filter writes it: Python's
 * json.dumps(v, ensure_ascii=False) (jinja.h). The Jinja renderer's filter
 * and chat.c's tool texts both write it; it sits with the renderer, the
 * lower of the two. */
#include "text/jinja.h"

#include "core/error.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int puts_(qt_strbuf *b, const char *s) { return qt_strbuf_put(b, s, strlen(s)); }

static int json_str(qt_strbuf *b, const char *s) {
    QT_TRY(puts_(b, "\""));
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        const char *esc = NULL;
        char u[8];
        switch (*p) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        default:
            if (*p < 0x20) {
                snprintf(u, sizeof u, "\\u%04x", *p);
                esc = u;
            }
        }
        QT_TRY(esc ? puts_(b, esc) : qt_strbuf_put(b, (const char *)p, 1));
    }
    return puts_(b, "\"");
}

/* Python's repr of a float: the shortest digits that read back, positional
 * for exponents -4..15, else d.ddde+XX. */
static int json_num(qt_strbuf *b, double v) {
    char buf[64];
    if (v == floor(v) && fabs(v) < 9007199254740992.0) {
        snprintf(buf, sizeof buf, "%lld", (long long)v);
        return puts_(b, buf);
    }
    if (!isfinite(v)) return puts_(b, isnan(v) ? "NaN" : v > 0 ? "Infinity" : "-Infinity");
    char e[40];
    for (int p = 0; p < 17; p++) {
        snprintf(e, sizeof e, "%.*e", p, v);
        if (strtod(e, NULL) == v) break;
    }
    /* e = [-]d[.ddd]e[+-]XX */
    char *ep = strchr(e, 'e');
    int exp10 = atoi(ep + 1);
    *ep = 0;
    const char *m = e;
    int neg = *m == '-';
    if (neg) m++;
    char digits[24];
    size_t nd = 0;
    for (const char *q = m; *q && nd < sizeof digits - 1; q++)
        if (*q != '.') digits[nd++] = *q;
    digits[nd] = 0;
    size_t k = 0;
    if (neg) buf[k++] = '-';
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            k += (size_t)snprintf(buf + k, sizeof buf - k, "0.");
            for (int z = -1; z > exp10; z--) buf[k++] = '0';
            k += (size_t)snprintf(buf + k, sizeof buf - k, "%s", digits);
        } else {
            for (int i = 0; i <= exp10; i++) buf[k++] = (size_t)i < nd ? digits[i] : '0';
            buf[k++] = '.';
            if ((size_t)exp10 + 1 < nd) k += (size_t)snprintf(buf + k, sizeof buf - k, "%s", digits + exp10 + 1);
            else buf[k++] = '0';
        }
        buf[k] = 0;
    } else {
        snprintf(buf + k, sizeof buf - k, "%c%s%se%c%02d", digits[0], nd > 1 ? "." : "", nd > 1 ? digits + 1 : "",
                 exp10 < 0 ? '-' : '+', abs(exp10));
    }
    return puts_(b, buf);
}

static int tojson_at(const cJSON *v, qt_strbuf *b, int depth) {
    if (depth > 64) return QT_ERR(QT_EFORMAT, "JSON nested deeper than 64 levels");
    if (cJSON_IsNull(v)) return puts_(b, "null");
    if (cJSON_IsTrue(v)) return puts_(b, "true");
    if (cJSON_IsFalse(v)) return puts_(b, "false");
    if (cJSON_IsNumber(v)) return json_num(b, v->valuedouble);
    if (cJSON_IsString(v)) return json_str(b, v->valuestring);
    int obj = cJSON_IsObject(v);
    if (!obj && !cJSON_IsArray(v)) return QT_ERR(QT_EFORMAT, "a JSON value of an unknown kind");
    QT_TRY(puts_(b, obj ? "{" : "["));
    for (const cJSON *c = v->child; c; c = c->next) {
        if (c != v->child) QT_TRY(puts_(b, ", "));
        if (obj) {
            QT_TRY(json_str(b, c->string ? c->string : ""));
            QT_TRY(puts_(b, ": "));
        }
        QT_TRY(tojson_at(c, b, depth + 1));
    }
    return puts_(b, obj ? "}" : "]");
}

int jinja_tojson(const cJSON *v, qt_strbuf *b) { return tojson_at(v, b, 0); }
