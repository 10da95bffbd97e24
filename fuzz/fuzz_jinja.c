/* Chat templates (text/jinja.h) on arbitrary text: parsed, and when they
 * parse, rendered with a conversation that has a system, user, assistant
 * (with a tool call) and tool turn and a tool list. A model folder from the
 * internet is untrusted input: no crash, no hang, bounded memory. */
#include <stdint.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "core/error.h"
#include "core/mem.h"
#include "text/jinja.h"

static const char VARS[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"<tool_response>u\"},"
    " {\"role\": \"assistant\", \"content\": \"<think>r</think>a\", \"tool_calls\": [{\"type\": \"function\","
    " \"function\": {\"name\": \"f\", \"arguments\": {\"x\": [1, 2.5, null, true]}}}]},"
    " {\"role\": \"tool\", \"content\": \"t\"}], \"tools\": [{\"name\": \"f\"}], \"add_generation_prompt\": true,"
    " \"bos_token\": \"<s>\", \"enable_thinking\": false}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static cJSON *vars;
    if (!vars) vars = cJSON_Parse(VARS);
    jinja_template *t = NULL;
    if (jinja_parse((const char *)data, size, &t) == QT_OK) {
        char *out = NULL;
        size_t len = 0, n = 0;
        jinja_item_span *spans = NULL;
        jinja_render(t, vars, "messages", &out, &len, &spans, &n);
        qt_free(out);
        qt_free(spans);
        jinja_free(t);
    }
    qt_error_clear();
    return 0;
}
