/* test_rewrite: the hop bodies of docs/protocol.md. Each rewritten body is
 * parsed back and compared field by field with the client's body: the
 * prefill body differs exactly in the fields the protocol names, the decode
 * body is the original plus the prefill's kv_transfer_params (the bytes of
 * the original kept as sent), and the error bodies have the OpenAI shape. */
#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "proxy/rewrite.h"
#include "tests/common/testlib.h"

/* Every field of a other than the skipped ones is present and equal in b. */
static bool same_fields(const cJSON *a, const cJSON *b, const char *const *skip, int n_skip) {
    for (const cJSON *it = a->child; it; it = it->next) {
        bool skipped = false;
        for (int i = 0; i < n_skip; i++)
            skipped |= !strcmp(it->string, skip[i]);
        if (skipped) continue;
        const cJSON *o = cJSON_GetObjectItemCaseSensitive(b, it->string);
        if (!o || !cJSON_Compare(it, o, 1)) return false;
    }
    return true;
}

static void test_prefill(void) {
    const char *bodies[] = {
        "{\"model\":\"m\",\"prompt\":\"Hi\",\"max_tokens\":50,\"stream\":true,"
        "\"stream_options\":{\"include_usage\":true},\"temperature\":0.7,\"min_tokens\":5}",
        "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
        "\"max_completion_tokens\":9,\"seed\":123456789}",
        "{\"prompt\":[1,2,3]}",
        "{\"prompt\":\"a\",\"kv_transfer_params\":{\"junk\":1}}",
    };
    for (size_t i = 0; i < sizeof bodies / sizeof bodies[0]; i++) {
        cJSON *root = cJSON_Parse(bodies[i]);
        size_t len = 0;
        char *p = rewrite_prefill_body(root, "10.1.1.1:14580", &len);
        CHECK(p && len == strlen(p));
        cJSON *pj = cJSON_Parse(p);
        CHECK(pj != NULL);
        const char *changed[] = {"max_tokens", "max_completion_tokens", "stream", "stream_options",
                                 "min_tokens", "kv_transfer_params"};
        CHECKF(same_fields(root, pj, changed, 6), "body %zu: %s", i, p);
        CHECK(cJSON_GetObjectItem(pj, "max_tokens")->valuedouble == 1);
        const cJSON *mct = cJSON_GetObjectItem(pj, "max_completion_tokens");
        CHECK(!!mct == !!cJSON_GetObjectItem(root, "max_completion_tokens"));
        if (mct) CHECK(mct->valuedouble == 1);
        CHECK(cJSON_IsFalse(cJSON_GetObjectItem(pj, "stream")));
        CHECK(!cJSON_GetObjectItem(pj, "stream_options") && !cJSON_GetObjectItem(pj, "min_tokens"));
        cJSON *want =
            cJSON_Parse("{\"do_remote_decode\":true,\"remote_kv_addr\":\"10.1.1.1:14580\"}");
        CHECK(cJSON_Compare(cJSON_GetObjectItem(pj, "kv_transfer_params"), want, 1));
        cJSON_Delete(want);
        cJSON_Delete(pj);
        cJSON_free(p);
        cJSON_Delete(root);
    }
}

static void test_decode(void) {
    const char *params = "{\"do_remote_prefill\":true,\"remote_kv_addr\":\"10.0.0.2:14579\","
                         "\"remote_request_id\":\"t-7\",\"num_tokens\":12}";
    const char *bodies[] = {
        "{\"model\":\"m\",\"prompt\":\"Hi\",\"max_tokens\":50,\"stream\":true,"
        "\"seed\":18446744073709551615}",
        "  {\"prompt\":\"x\"}  \n",
        "{}",
        "{ \n }",
        "{\"prompt\":\"a\",\"kv_transfer_params\":{\"client\":1}}",
    };
    for (size_t i = 0; i < sizeof bodies / sizeof bodies[0]; i++) {
        const char *orig = bodies[i];
        cJSON *root = cJSON_Parse(orig);
        size_t len = 0;
        char *d = rewrite_decode_body(orig, strlen(orig), root, params, &len);
        cJSON *dj = d ? cJSON_Parse(d) : NULL;
        CHECKF(dj != NULL, "body %zu: %s", i, d ? d : "(null)");
        if (!dj) continue;
        const char *skip[] = {"kv_transfer_params"};
        CHECK(same_fields(root, dj, skip, 1) && same_fields(dj, root, skip, 1));
        cJSON *want = cJSON_Parse(params);
        CHECK(cJSON_Compare(cJSON_GetObjectItem(dj, "kv_transfer_params"), want, 1));
        cJSON_Delete(want);
        /* Without a client kv_transfer_params the original bytes survive verbatim
         * (a 20-digit seed is not re-printed as a double). */
        if (!cJSON_GetObjectItem(root, "kv_transfer_params")) {
            size_t n = strlen(orig);
            while (n && orig[n - 1] != '}')
                n--;
            CHECK(!strncmp(d, orig, n - 1));
        }
        free(d);
        cJSON_Delete(dj);
        /* No params from the prefill: the original, untouched (or the client's own params dropped).
         */
        d = rewrite_decode_body(orig, strlen(orig), root, NULL, &len);
        if (!cJSON_GetObjectItem(root, "kv_transfer_params")) {
            CHECK(len == strlen(orig) && !memcmp(d, orig, len));
        } else {
            dj = cJSON_Parse(d);
            CHECK(dj && !cJSON_GetObjectItem(dj, "kv_transfer_params"));
            cJSON_Delete(dj);
        }
        free(d);
        cJSON_Delete(root);
    }
}

static void test_answers_and_errors(void) {
    char *p = NULL;
    const char *ans = "{\"choices\":[],\"kv_transfer_params\":{\"remote_request_id\":\"x\","
                      "\"remote_kv_addr\":\"h:1\"}}";
    CHECK(rewrite_prefill_answer(ans, strlen(ans), &p) == 0 && p);
    cJSON *a = cJSON_Parse(p),
          *w = cJSON_Parse("{\"remote_request_id\":\"x\",\"remote_kv_addr\":\"h:1\"}");
    CHECK(cJSON_Compare(a, w, 1));
    cJSON_Delete(a);
    cJSON_Delete(w);
    cJSON_free(p);
    CHECK(rewrite_prefill_answer("{\"kv_transfer_params\":null}", 27, &p) == 0 && !p);
    CHECK(rewrite_prefill_answer("{\"choices\":[]}", 14, &p) == 0 && !p);
    CHECK(rewrite_prefill_answer("{\"kv_transfer_params\":3}", 24, &p) != 0);
    CHECK(rewrite_prefill_answer("not json", 8, &p) != 0);
    CHECK(rewrite_prefill_answer("[1]", 3, &p) != 0);

    size_t len;
    char *e = rewrite_error_json(502, "decode instance \"h:1\" failed", &len);
    cJSON *ej = cJSON_Parse(e);
    const cJSON *eo = cJSON_GetObjectItem(ej, "error");
    CHECK(eo && !strcmp(cJSON_GetObjectItem(eo, "message")->valuestring,
                        "decode instance \"h:1\" failed"));
    CHECK(!strcmp(cJSON_GetObjectItem(eo, "type")->valuestring, "BadGatewayError"));
    CHECK(cJSON_IsNull(cJSON_GetObjectItem(eo, "param")));
    CHECK(cJSON_GetObjectItem(eo, "code")->valuedouble == 502);
    cJSON_Delete(ej);
    free(e);
    const char *up = "{\"error\":{\"message\":\"KV wait timed out\",\"type\":\"Timeout\","
                     "\"param\":\"x\",\"code\":504}}";
    e = rewrite_upstream_error(up, strlen(up), 504, "decode instance h:1", &len);
    ej = cJSON_Parse(e);
    eo = cJSON_GetObjectItem(ej, "error");
    CHECK(!strcmp(cJSON_GetObjectItem(eo, "message")->valuestring,
                  "decode instance h:1: KV wait timed out"));
    CHECK(!strcmp(cJSON_GetObjectItem(eo, "type")->valuestring, "Timeout"));
    CHECK(!strcmp(cJSON_GetObjectItem(eo, "param")->valuestring, "x"));
    CHECK(cJSON_GetObjectItem(eo, "code")->valuedouble == 504);
    cJSON_Delete(ej);
    free(e);
    e = rewrite_upstream_error("<html>", 6, 500, "decode instance h:1", &len);
    ej = cJSON_Parse(e);
    eo = cJSON_GetObjectItem(ej, "error");
    CHECK(eo && strstr(cJSON_GetObjectItem(eo, "message")->valuestring, "HTTP 500"));
    cJSON_Delete(ej);
    free(e);
}

int main(void) {
    test_prefill();
    test_decode();
    test_answers_and_errors();
    return test_finish();
}
