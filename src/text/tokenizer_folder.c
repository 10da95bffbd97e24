/* A model folder's tokenizer as bpe_load gives it (tokenizer.h): the
 * vocabulary, merges and pre-tokenizer (tokenizer.c) with the folder's chat
 * template beside them (chat_template.c), the one file that calls both, so
 * that neither calls the other back: the tokenizer knows its template only
 * as a pointer, and the template encodes through the tokenizer. */
#include "text/bpe_impl.h"
#include "text/chat_template.h"

#include "core/error.h"

int bpe_load(const char *path, bpe_tokenizer **out) {
    char dir[4096];
    QT_TRY(bpe_load_vocab(path, out, dir, sizeof dir));
    int rc = chat_template_load_dir(dir, &(*out)->tmpl); /* the folder's chat template, beside the tokenizer file */
    if (rc != QT_OK) {
        bpe_free(*out);
        *out = NULL;
    }
    return rc;
}

void bpe_free(bpe_tokenizer *t) {
    if (!t) return;
    chat_template_free(t->tmpl);
    bpe_free_vocab(t);
}

uint64_t bpe_hash(const bpe_tokenizer *t) {
    /* the chat template renders the cached conversations too: a changed template is a changed cache */
    return t->tmpl ? t->hash ^ (chat_template_hash(t->tmpl) * 0x9E3779B97F4A7C15ull + 1) : t->hash;
}
