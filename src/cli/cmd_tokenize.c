/* qtune tokenize: text -> token ids, or ids -> text, with a model's
 * tokenizer.json. The encoder is src/text/ (docs/tokenizer.md). */
#include "cli/cli.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "data/format.h"
#include "text/chat.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void help(void) {
    printf("usage: qtune tokenize --tokenizer PATH (--text TEXT | --file F | --decode IDS | --chat F)\n"
           "                      [--chat-template FILE|chatml] [--json]\n\n"
           "Encode text to token ids, or decode ids to text, exactly as Hugging Face tokenizers does\n"
           "with the same tokenizer.json (special tokens written in the text are matched).\n\n"
           "  --tokenizer PATH  a tokenizer.json, or a model folder that holds one\n"
           "  --text TEXT       encode TEXT\n"
           "  --file F          encode the bytes of file F (invalid UTF-8 becomes U+FFFD first)\n"
           "  --decode IDS      decode ids separated by commas and/or spaces, e.g. \"9707,11,1879\";\n"
           "                    @FILE reads the ids from FILE (same syntax; a JSON array works too)\n"
           "  --chat F          F is JSON {\"messages\": [{\"role\", \"content\"}, ...], \"add_generation_prompt\": false,\n"
           "                    \"enable_thinking\": false, \"chat_template_kwargs\": {...}} (the last two optional):\n"
           "                    render it with the folder's chat template (chat_template.jinja or tokenizer_config.json's\n"
           "                    chat_template; qtune's ChatML when it ships none) and print {\"text\", \"ids\", \"labels\",\n"
           "                    \"chat_template\"} (labels: the id where the token is trained on, -100 elsewhere)\n"
           "  --chat-template FILE  render with the Jinja template in FILE instead; \"chatml\": qtune's ChatML\n"
           "  --json            print {\"ids\": [...]} or {\"text\": \"...\"} instead of plain output\n\n"
           "Plain output: ids separated by spaces on one line, or the decoded text followed by a newline.\n");
}

/* JSON string body: quotes, backslashes and control bytes escaped, UTF-8 kept. */
static void json_string(FILE *f, const char *s, size_t n) {
    fputc('"', f);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c == '\n') fputs("\\n", f);
        else if (c == '\r') fputs("\\r", f);
        else if (c == '\t') fputs("\\t", f);
        else if (c < 0x20 || c == 0x7f) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

/* "1,2 3" or "[1, 2, 3]" -> ids; QT_EINVAL names the first bad item. */
static int parse_ids(const char *s, int32_t **ids, size_t *n) {
    size_t cap = 16;
    *n = 0;
    *ids = qt_malloc(cap * sizeof **ids, "token ids");
    if (!*ids) return QT_ENOMEM;
    const char *p = s;
    for (;;) {
        while (*p == ',' || *p == ' ' || *p == '\t' || *p == '\n' || *p == '\r' || *p == '[' || *p == ']') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX || (*end && !strchr(", \t\r\n[]", *end))) {
            int len = 0;
            while (p[len] && !strchr(", \t\r\n[]", p[len]) && len < 40) len++;
            return QT_ERR(QT_EINVAL, "--decode: \"%.*s\" is not a token id; give non-negative whole numbers separated by commas or spaces",
                          len, p);
        }
        if (*n == cap) {
            cap *= 2;
            int32_t *g = qt_realloc(*ids, cap * sizeof *g, "token ids");
            if (!g) return QT_ENOMEM;
            *ids = g;
        }
        (*ids)[(*n)++] = (int32_t)v;
        p = end;
    }
    return QT_OK;
}

/* --chat F: {"messages": [...], "add_generation_prompt": bool} -> text, ids, labels. */
static int run_chat(bpe_tokenizer *t, const char *path) {
    char *buf;
    size_t len;
    QT_TRY(qt_read_file(path, (size_t)1 << 30, &buf, &len));
    cJSON *root = cJSON_ParseWithLength(buf, len);
    qt_free(buf);
    if (!root) return QT_ERR(QT_EFORMAT, "%s is not valid JSON", path);
    int gen = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(root, "add_generation_prompt"));
    /* apply_chat_template's keyword arguments: enable_thinking, or any under chat_template_kwargs */
    const cJSON *think = cJSON_GetObjectItemCaseSensitive(root, "enable_thinking");
    const cJSON *kw = cJSON_GetObjectItemCaseSensitive(root, "chat_template_kwargs");
    chat_template *ct = bpe_chat_template_mut(t);
    int rc = QT_OK;
    if ((think || cJSON_IsObject(kw)) && !ct)
        rc = QT_ERR(QT_EINVAL, "%s: enable_thinking / chat_template_kwargs need a chat template, and the tokenizer's folder "
                    "ships none (qtune's ChatML default takes no variables)", path);
    if (rc == QT_OK && think) rc = chat_template_set_var(ct, "enable_thinking", think);
    for (const cJSON *v = cJSON_IsObject(kw) ? kw->child : NULL; rc == QT_OK && v; v = v->next)
        rc = chat_template_set_var(ct, v->string, v);
    char *text = NULL;
    size_t tl = 0, nids = 0;
    int32_t *ids = NULL, *labels = NULL;
    if (rc == QT_OK) rc = dl_chat_encode_json(t, root, gen, &text, &tl, &ids, &labels, &nids);
    if (rc != QT_OK) rc = qt_error_context(rc, "%s", path);
    if (rc == QT_OK) {
        fputs("{\"text\": ", stdout);
        json_string(stdout, text, tl);
        fputs(", \"ids\": [", stdout);
        for (size_t k = 0; k < nids; k++) printf(k ? ", %d" : "%d", ids[k]);
        fputs("], \"labels\": [", stdout);
        for (size_t k = 0; k < nids; k++) printf(k ? ", %d" : "%d", labels[k]);
        char desc[512];
        chat_template_describe(t, desc, sizeof desc);
        fputs("], \"chat_template\": ", stdout);
        json_string(stdout, desc, strlen(desc));
        fputs("}\n", stdout);
    }
    qt_free(text);
    qt_free(ids);
    qt_free(labels);
    cJSON_Delete(root);
    return rc;
}

int cmd_tokenize(int argc, char **argv) {
    if (cli_wants_help(argc, argv)) {
        help();
        return QT_EXIT_OK;
    }
    const char *tok_path = NULL, *text = NULL, *file = NULL, *decode = NULL, *chat = NULL, *tmpl = NULL;
    int json = 0;
    cli_once_list once = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char **dst = !strcmp(a, "--tokenizer") ? &tok_path : !strcmp(a, "--text") ? &text
                         : !strcmp(a, "--file")      ? &file
                         : !strcmp(a, "--decode")    ? &decode
                         : !strcmp(a, "--chat")      ? &chat
                         : !strcmp(a, "--chat-template") ? &tmpl
                                                     : NULL;
        if (dst) {
            if (cli_value(&once, "tokenize", a, i + 1 < argc ? argv[i + 1] : NULL)) return QT_EXIT_USAGE;
            *dst = argv[++i];
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else {
            return cli_usage_error("tokenize", "unknown option '%s'", a);
        }
    }
    if (!tok_path) return cli_usage_error("tokenize", "--tokenizer PATH is required");
    if ((text != NULL) + (file != NULL) + (decode != NULL) + (chat != NULL) != 1)
        return cli_usage_error("tokenize", "give exactly one of --text, --file, --decode or --chat");

    int32_t *ids = NULL;
    size_t n = 0, cap = 0;
    if (decode) {
        char *idbuf = NULL;
        size_t idlen;
        if (decode[0] == '@' && qt_read_file(decode + 1, (size_t)1 << 32, &idbuf, &idlen) != QT_OK) return cli_fail();
        int prc = parse_ids(idbuf ? idbuf : decode, &ids, &n);
        qt_free(idbuf);
        if (prc != QT_OK) {
            qt_free(ids);
            return cli_usage_error("tokenize", "%s", qt_error_message());
        }
    }
    bpe_tokenizer *t;
    if (bpe_load(tok_path, &t) != QT_OK) {
        qt_free(ids);
        qt_error_oom_advice(qt_error_code(), QT_TOKENIZER_OOM_ADVICE);
        return cli_fail();
    }
    int rc = QT_OK;
    if (tmpl) {
        char dir[4096];
        if (qt_is_dir(tok_path)) snprintf(dir, sizeof dir, "%s", tok_path);
        else qt_path_dirname(dir, sizeof dir, tok_path);
        rc = chat_template_override(t, tmpl, dir);
    }
    if (rc != QT_OK) {
    } else if (chat) {
        rc = run_chat(t, chat);
    } else if (decode) {
        char *out;
        size_t len;
        rc = bpe_decode(t, ids, n, &out, &len);
        if (rc == QT_OK) {
            if (json) {
                fputs("{\"text\": ", stdout);
                json_string(stdout, out, len);
                fputs("}\n", stdout);
            } else {
                fwrite(out, 1, len, stdout);
                fputc('\n', stdout);
            }
            qt_free(out);
        }
    } else {
        char *buf = NULL;
        size_t len = 0;
        if (file) rc = qt_read_file(file, (size_t)1 << 34, &buf, &len);
        if (rc == QT_OK) rc = bpe_encode(t, file ? buf : text, file ? len : strlen(text), &ids, &n, &cap);
        qt_free(buf);
        if (rc == QT_OK) {
            fputs(json ? "{\"ids\": [" : "", stdout);
            for (size_t i = 0; i < n; i++) printf(i ? (json ? ", %d" : " %d") : "%d", ids[i]);
            fputs(json ? "]}\n" : "\n", stdout);
        }
    }
    qt_free(ids);
    bpe_free(t);
    if (rc != QT_OK) return cli_fail();
    if (fflush(stdout) != 0) {
        fprintf(stderr, "qtune: error: could not write the output (disk full or closed pipe?)\n");
        return QT_EXIT_FAIL;
    }
    return QT_EXIT_OK;
}
