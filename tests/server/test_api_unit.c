/* test_api_unit: the HTTP layer's pure parts, without a model or sockets —
 * JSON string writing, /v1/completions request parsing and validation,
 * length checks, stop strings and hold-back (against a brute-force
 * reference), UTF-8 boundaries, response / SSE / error JSON (parsed back
 * with cJSON), logprobs objects, Prometheus histograms (against counts
 * computed here), the `pdserve serve` flags and the --device / --dtype rule.
 *
 * The server sources are not in pdcore (they belong to the pdserve
 * program), so the ones under test are compiled into this test directly. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "server/api_completions.c"
#include "server/api_json.c"
#include "server/cli.c"
#include "server/metrics.c"
#include "server/serve_options.c"
#include "tests/common/testlib.h"

static api_limits LIM;

static int parse(const char *body, completion_request *r, api_error *e) {
    memset(e, 0, sizeof *e);
    return completion_request_parse(body, strlen(body), &LIM, r, e);
}

static void test_json_strings(void) {
    /* Every ASCII byte but NUL plus multi-byte UTF-8 survives a round trip through cJSON. */
    char text[200];
    int k = 0;
    for (int c = 1; c < 128; c++)
        text[k++] = (char)c;
    const char *u = "caf\xc3\xa9 \xe6\x97\xa5 \xf0\x9f\x98\x80";
    memcpy(text + k, u, strlen(u));
    k += (int)strlen(u);
    text[k] = 0;
    pd_buf b;
    pd_buf_init(&b);
    jb_str(&b, text, (size_t)k);
    cJSON *j = cJSON_Parse(b.data);
    CHECKF(cJSON_IsString(j) && !strcmp(j->valuestring, text), "round trip of %s", b.data);
    cJSON_Delete(j);
    pd_buf_free(&b);
    /* NUL is escaped, and invalid UTF-8 becomes U+FFFD so the output stays valid JSON. */
    jb_str(&b, "a\0b\xff\xc3", 5);
    CHECKF(b.data && strstr(b.data, "\\u0000"), "NUL escaped: %s", b.data);
    j = cJSON_Parse(b.data);
    CHECK(j && cJSON_IsString(j));
    if (j) CHECKF(!strcmp(j->valuestring, "a"), "cJSON stops at the NUL"); /* its limit, not ours */
    cJSON_Delete(j);
    pd_buf_free(&b);
    jb_str(&b, "x\xffy\xe6\x97", 5);
    CHECKF(!strcmp(b.data, "\"x\xef\xbf\xbdy\xef\xbf\xbd\xef\xbf\xbd\""), "replacement: %s",
           b.data);
    pd_buf_free(&b);
    /* Numbers: integral floats keep a decimal point; non-finite ones become null. */
    jb_num(&b, -2.0);
    pd_buf_puts(&b, " ");
    jb_num(&b, INFINITY);
    pd_buf_puts(&b, " ");
    jb_num(&b, 0.1);
    CHECKF(!strncmp(b.data, "-2.0 null ", 10) && strtod(b.data + 10, NULL) == 0.1, "numbers: %s",
           b.data);
    pd_buf_free(&b);
}

static void test_parse_forms(void) {
    completion_request r;
    api_error e;
    CHECK(parse("{\"prompt\":\"Hello\"}", &r, &e) == 0);
    CHECK(r.n_prompts == 1 && r.prompts[0].text && !strcmp(r.prompts[0].text, "Hello"));
    CHECK(r.max_tokens == 16 && r.n == 1 && r.logprobs == -1 && !r.stream && !r.echo);
    CHECK(r.sampling.temperature == 1.0f && r.sampling.top_p == 1.0f && r.sampling.top_k == 0);
    CHECK(r.add_special_tokens && r.skip_special_tokens && !r.model && !r.kv_transfer_params);
    completion_request_free(&r);

    CHECK(parse("{\"prompt\":[\"a\",\"b\",\"c\"],\"max_tokens\":null,\"model\":\"m\"}", &r, &e) ==
          0);
    CHECK(r.n_prompts == 3 && !strcmp(r.prompts[2].text, "c") && r.max_tokens == 16);
    CHECK(r.model && !strcmp(r.model, "m"));
    completion_request_free(&r);

    CHECK(parse("{\"prompt\":[2, 31414, 0]}", &r, &e) == 0);
    CHECK(r.n_prompts == 1 && r.prompts[0].n_ids == 3 && r.prompts[0].ids[1] == 31414);
    completion_request_free(&r);

    CHECK(parse("{\"prompt\":[[1,2],[3],[4,5,6]],\"n\":2}", &r, &e) == 0);
    CHECK(r.n_prompts == 3 && r.prompts[2].n_ids == 3 && r.prompts[1].ids[0] == 3 && r.n == 2);
    completion_request_free(&r);

    const char *full =
        "{\"prompt\":\"x\",\"max_tokens\":7,\"temperature\":0,\"top_p\":0.5,\"top_k\":-1,"
        "\"min_p\":0.1,\"n\":3,\"stop\":\"END\",\"stop_token_ids\":[5,6],\"ignore_eos\":true,"
        "\"min_tokens\":2,\"seed\":-3,\"presence_penalty\":0.5,\"frequency_penalty\":-0.5,"
        "\"repetition_penalty\":1.2,\"logprobs\":5,\"echo\":true,\"stream\":true,"
        "\"stream_options\":{\"include_usage\":true},\"user\":\"u\",\"suffix\":null,"
        "\"kv_transfer_params\":{\"do_remote_decode\":true,\"remote_kv_addr\":\"1.2.3.4:5\","
        "\"n\":[1,{\"a\":null}]},\"add_special_tokens\":false,\"skip_special_tokens\":false,"
        "\"include_stop_str_in_output\":true,\"some_future_field\":{\"x\":[1,2]}}";
    CHECKF(parse(full, &r, &e) == 0, "full request: %s", e.message);
    CHECK(r.max_tokens == 7 && r.sampling.temperature == 0 &&
          fabsf(r.sampling.top_p - 0.5f) < 1e-6);
    CHECK(r.sampling.top_k == 0 && fabsf(r.sampling.min_p - 0.1f) < 1e-6 && r.n == 3);
    CHECK(r.n_stop == 1 && !strcmp(r.stop[0], "END") && r.n_stop_ids == 2 && r.stop_ids[1] == 6);
    CHECK(r.ignore_eos && r.min_tokens == 2 && r.sampling.has_seed &&
          r.sampling.seed == (uint64_t)(int64_t)-3);
    CHECK(fabsf(r.sampling.repetition_penalty - 1.2f) < 1e-6 && r.logprobs == 5 && r.echo);
    CHECK(r.stream && r.include_usage && !r.continuous_usage && !r.add_special_tokens);
    CHECK(!r.skip_special_tokens && r.include_stop_str_in_output);
    /* kv_transfer_params is kept as the same JSON object. */
    cJSON *in = cJSON_Parse(full);
    cJSON *kv = r.kv_transfer_params ? cJSON_Parse(r.kv_transfer_params) : NULL;
    CHECK(kv && cJSON_Compare(kv, cJSON_GetObjectItem(in, "kv_transfer_params"), 1));
    cJSON_Delete(kv);
    cJSON_Delete(in);
    completion_request_free(&r);

    CHECK(parse("{\"prompt\":\"x\",\"stream\":true,\"stream_options\":{}}", &r, &e) == 0);
    CHECK(r.include_usage); /* vLLM's default inside a given stream_options */
    completion_request_free(&r);
    CHECK(parse("{\"prompt\":\"x\",\"echo\":true,\"max_tokens\":0}", &r, &e) == 0);
    completion_request_free(&r);
    CHECK(parse("{\"prompt\":\"x\",\"kv_transfer_params\":null,\"max_tokens\":2.0}", &r, &e) == 0);
    CHECK(!r.kv_transfer_params && r.max_tokens == 2);
    completion_request_free(&r);
}

typedef struct bad_case {
    const char *body;
    const char *param; /* expected e.param ("" for none) */
} bad_case;

static void test_parse_errors(void) {
    static const bad_case cases[] = {
        {"", ""},
        {"{", ""},
        {"{\"prompt\":\"x\"", ""},
        {"{\"prompt\":\"x\"} x", ""},
        {"[1,2]", ""},
        {"null", ""},
        {"\"prompt\"", ""},
        {"{}", "prompt"},
        {"{\"prompt\":null}", "prompt"},
        {"{\"prompt\":\"\"}", "prompt"},
        {"{\"prompt\":[]}", "prompt"},
        {"{\"prompt\":[[]]}", "prompt[0]"},
        {"{\"prompt\":[1,-2]}", "prompt"},
        {"{\"prompt\":[1,2.5]}", "prompt"},
        {"{\"prompt\":[1,\"a\"]}", "prompt"},
        {"{\"prompt\":[\"a\",1]}", "prompt"},
        {"{\"prompt\":[[1],\"a\"]}", "prompt"},
        {"{\"prompt\":[1e300]}", "prompt"},
        {"{\"prompt\":{\"a\":1}}", "prompt"},
        {"{\"prompt\":5}", "prompt"},
        {"{\"prompt\":true}", "prompt"},
        {"{\"prompt\":\"\\xff\"}", ""}, /* not a JSON escape: invalid JSON */
        {"{\"prompt\":\"x\",\"max_tokens\":-1}", "max_tokens"},
        {"{\"prompt\":\"x\",\"max_tokens\":0}", "max_tokens"},
        {"{\"prompt\":\"x\",\"max_tokens\":1.5}", "max_tokens"},
        {"{\"prompt\":\"x\",\"max_tokens\":\"5\"}", "max_tokens"},
        {"{\"prompt\":\"x\",\"max_tokens\":1e20}", "max_tokens"},
        {"{\"prompt\":\"x\",\"max_tokens\":99999999999999999999999}", "max_tokens"},
        {"{\"prompt\":\"x\",\"temperature\":-0.1}", "temperature"},
        {"{\"prompt\":\"x\",\"temperature\":\"hot\"}", "temperature"},
        {"{\"prompt\":\"x\",\"temperature\":1e999}", "temperature"},
        {"{\"prompt\":\"x\",\"top_p\":0}", "top_p"},
        {"{\"prompt\":\"x\",\"top_p\":1.0001}", "top_p"},
        {"{\"prompt\":\"x\",\"top_k\":-2}", "top_k"},
        {"{\"prompt\":\"x\",\"top_k\":2.5}", "top_k"},
        {"{\"prompt\":\"x\",\"min_p\":1.5}", "min_p"},
        {"{\"prompt\":\"x\",\"presence_penalty\":2.5}", "presence_penalty"},
        {"{\"prompt\":\"x\",\"frequency_penalty\":-3}", "frequency_penalty"},
        {"{\"prompt\":\"x\",\"repetition_penalty\":0}", "repetition_penalty"},
        {"{\"prompt\":\"x\",\"n\":0}", "n"},
        {"{\"prompt\":\"x\",\"n\":100000}", "n"},
        {"{\"prompt\":\"x\",\"logprobs\":21}", "logprobs"},
        {"{\"prompt\":\"x\",\"logprobs\":-1}", "logprobs"},
        {"{\"prompt\":\"x\",\"logprobs\":-5}", "logprobs"},
        {"{\"prompt\":\"x\",\"logprobs\":\"2\"}", "logprobs"},
        {"{\"prompt\":\"x\",\"stream\":\"yes\"}", "stream"},
        {"{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}", "stream_options"},
        {"{\"prompt\":\"x\",\"stream\":true,\"stream_options\":[]}", "stream_options"},
        {"{\"prompt\":\"x\",\"stream\":true,\"stream_options\":{\"include_usage\":1}}",
         "stream_options"},
        {"{\"prompt\":\"x\",\"stop\":\"\"}", "stop"},
        {"{\"prompt\":\"x\",\"stop\":[\"a\",\"\"]}", "stop"},
        {"{\"prompt\":\"x\",\"stop\":[\"a\",3]}", "stop"},
        {"{\"prompt\":\"x\",\"stop\":7}", "stop"},
        {"{\"prompt\":\"x\",\"stop_token_ids\":[-1]}", "stop_token_ids"},
        {"{\"prompt\":\"x\",\"stop_token_ids\":5}", "stop_token_ids"},
        {"{\"prompt\":\"x\",\"echo\":1}", "echo"},
        {"{\"prompt\":\"x\",\"ignore_eos\":\"true\"}", "ignore_eos"},
        {"{\"prompt\":\"x\",\"min_tokens\":-1}", "min_tokens"},
        {"{\"prompt\":\"x\",\"min_tokens\":20,\"max_tokens\":10}", "min_tokens"},
        {"{\"prompt\":\"x\",\"seed\":\"s\"}", "seed"},
        {"{\"prompt\":\"x\",\"seed\":1e30}", "seed"},
        {"{\"prompt\":\"x\",\"model\":5}", "model"},
        {"{\"prompt\":\"x\",\"user\":5}", "user"},
        {"{\"prompt\":\"x\",\"kv_transfer_params\":\"abc\"}", "kv_transfer_params"},
        {"{\"prompt\":\"x\",\"kv_transfer_params\":[1]}", "kv_transfer_params"},
        {"{\"prompt\":\"x\",\"prompt_logprobs\":1,\"stream\":true}", "prompt_logprobs"},
        {"{\"prompt\":\"x\",\"logit_bias\":{\"5\":1}}", "logit_bias"},
        {"{\"prompt\":\"x\",\"use_beam_search\":true}", "use_beam_search"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        completion_request r;
        api_error e;
        int rc = parse(cases[i].body, &r, &e);
        CHECKF(rc == -1 && e.status == 400, "case %zu %s: rc %d status %d", i, cases[i].body, rc,
               e.status);
        CHECKF(!strcmp(e.param, cases[i].param), "case %zu %s: param '%s', wanted '%s' (%s)", i,
               cases[i].body, e.param, cases[i].param, e.message);
        CHECKF(e.message[0] != 0, "case %zu has a message", i);
        CHECK(r.n_prompts == 0 && r.prompts == NULL); /* left empty */
    }
    /* Invalid UTF-8 inside a JSON string (raw bytes) is refused. */
    completion_request r;
    api_error e;
    const char bad_utf8[] = "{\"prompt\":\"a\xff\xfe\"}";
    CHECK(completion_request_parse(bad_utf8, sizeof bad_utf8 - 1, &LIM, &r, &e) == -1 &&
          e.status == 400 && !strcmp(e.param, "prompt"));
    const char bad_stop[] = "{\"prompt\":\"a\",\"stop\":\"\xc3\"}";
    CHECK(completion_request_parse(bad_stop, sizeof bad_stop - 1, &LIM, &r, &e) == -1 &&
          !strcmp(e.param, "stop"));
    /* vLLM's wording where the tests of clients look for it. */
    parse("{\"prompt\":\"x\",\"stop\":\"\"}", &r, &e);
    CHECK(!strcmp(e.message, "stop cannot contain an empty string."));
    parse("{\"prompt\":\"x\",\"logprobs\":21}", &r, &e);
    CHECK(strstr(e.message, "greater than max allowed: 20") != NULL);
}

static void test_check_prompt(void) {
    int32_t ids[10] = {2, 5, 6, 7, 8, 9, 10, 11, 12, 13};
    api_error e;
    CHECK(completion_check_prompt(ids, 4, 50272, 6, 10, &e) == 0); /* 4 + 6 == 10 */
    CHECK(completion_check_prompt(ids, 4, 50272, 7, 10, &e) == -1 && e.status == 400);
    CHECKF(strstr(e.message, "maximum context length") && strstr(e.message, "10") &&
               strstr(e.message, "7"),
           "%s", e.message);
    CHECK(completion_check_prompt(ids, 10, 50272, 1, 10, &e) == -1 &&
          strstr(e.message, "maximum context length"));
    CHECK(completion_check_prompt(ids, 0, 50272, 1, 10, &e) == -1);
    CHECK(completion_check_prompt(ids, 4, 7, 1, 100, &e) == -1 && strstr(e.message, "vocabulary"));
    CHECK(completion_check_prompt(ids, 4, 8, 1, 100, &e) == 0); /* largest id 7 < 8 */
}

/* The reference: after each append, the first stop (in list order) that
 * occurs anywhere in the text (nothing matched before, so any occurrence is new). */
static int stop_reference(const char *text, char *const *stop, int n, size_t *at) {
    for (int i = 0; i < n; i++) {
        const char *p = strstr(text, stop[i]);
        if (p) {
            *at = (size_t)(p - text);
            return i;
        }
    }
    return -1;
}

static void test_stop_strings(void) {
    unsigned seed = 12345;
    const char alphabet[] = "abc\xc3\xa9";
    for (int trial = 0; trial < 2000; trial++) {
        char *stops[3];
        char sbuf[3][8];
        int n_stop = 1 + trial % 3;
        for (int s = 0; s < n_stop; s++) {
            int len = 1 + (int)((seed = seed * 1103515245u + 12345u) >> 16) % 3;
            for (int k = 0; k < len; k++)
                sbuf[s][k] = alphabet[((seed = seed * 1103515245u + 12345u) >> 16) % 3];
            sbuf[s][len] = 0;
            stops[s] = sbuf[s];
        }
        char text[64] = {0};
        size_t len = 0;
        int got = -1, want = -1;
        size_t got_at = 0, want_at = 0;
        while (len < 40 && got < 0) {
            size_t prev = len;
            int piece = 1 + (int)((seed = seed * 1103515245u + 12345u) >> 16) % 3;
            for (int k = 0; k < piece; k++)
                text[len++] = alphabet[((seed = seed * 1103515245u + 12345u) >> 16) % 3];
            text[len] = 0;
            got = stop_find(text, len, prev, stops, n_stop, &got_at);
            want = stop_reference(text, stops, n_stop, &want_at);
            if (want >= 0) break;
        }
        CHECKF(got == want && (got < 0 || got_at == want_at), "trial %d: got %d@%zu want %d@%zu",
               trial, got, got_at, want, want_at);
    }
    /* Hold-back: the last (longest stop in characters - 1) characters. */
    char *st[] = {"ab", "\xc3\xa9\xc3\xa9\xc3\xa9"}; /* 2 and 3 characters */
    const char *t = "xy\xc3\xa9z";
    CHECK(stop_holdback(t, strlen(t), st, 2) == 3); /* "é" + "z" */
    CHECK(stop_holdback(t, strlen(t), st, 1) == 1); /* "z" */
    CHECK(stop_holdback("a", 1, st, 2) == 1);       /* never more than the text */
    CHECK(stop_holdback(t, strlen(t), NULL, 0) == 0);
    CHECK(utf8_chars(t, strlen(t)) == 4);
}

/* Reference boundary: walk whole characters from the start. */
static size_t boundary_reference(const char *s, size_t n) {
    size_t i = 0, last = 0;
    while (i < n) {
        unsigned char c = (unsigned char)s[i];
        size_t need = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : 4;
        if (i + need > n) break;
        i += need;
        last = i;
    }
    return last;
}

static void test_utf8_boundary(void) {
    const char *s = "a\xc3\xa9\xe6\x97\xa5\xf0\x9f\x98\x80z";
    size_t n = strlen(s);
    for (size_t k = 0; k <= n; k++)
        CHECKF(utf8_boundary(s, k) == boundary_reference(s, k), "prefix %zu: %zu vs %zu", k,
               utf8_boundary(s, k), boundary_reference(s, k));
}

static void test_responses(void) {
    lp_list lp = {0};
    const char *tops[3] = {" a", " b", " a"}; /* a duplicate key collapses */
    double tlp[3] = {-0.1, -INFINITY, -3};
    CHECK(lp_list_add(&lp, " a", 0, true, -0.1, 3, tops, tlp) == 0);
    CHECK(lp_list_add(&lp, "</s>", 2, false, 0, 0, NULL, NULL) == 0);
    choice_view cv[2] = {
        {.index = 0, .text = "hi\"there", .text_len = 8, .finish_reason = "length"},
        {.index = 1,
         .text = "x",
         .text_len = 1,
         .logprobs = &lp,
         .finish_reason = "stop",
         .stop_kind = STOP_REASON_ID,
         .stop_id = 42},
    };
    completion_meta m = {"cmpl-abc", 1700000000, "tiny"};
    size_t len = 0;
    char *body = completion_response_json(&m, cv, 2, 5, 7, "{\"k\":1}", &len);
    CHECK(body && len == strlen(body));
    cJSON *j = cJSON_Parse(body);
    CHECKF(j != NULL, "response parses: %s", body);
    CHECK(!strcmp(cJSON_GetObjectItem(j, "id")->valuestring, "cmpl-abc"));
    CHECK(!strcmp(cJSON_GetObjectItem(j, "object")->valuestring, "text_completion"));
    CHECK(cJSON_GetObjectItem(j, "created")->valuedouble == 1700000000);
    cJSON *ch = cJSON_GetObjectItem(j, "choices");
    CHECK(cJSON_GetArraySize(ch) == 2);
    cJSON *c0 = cJSON_GetArrayItem(ch, 0), *c1 = cJSON_GetArrayItem(ch, 1);
    CHECK(!strcmp(cJSON_GetObjectItem(c0, "text")->valuestring, "hi\"there"));
    CHECK(cJSON_IsNull(cJSON_GetObjectItem(c0, "logprobs")) &&
          cJSON_IsNull(cJSON_GetObjectItem(c0, "stop_reason")));
    CHECK(cJSON_GetObjectItem(c1, "stop_reason")->valuedouble == 42);
    cJSON *l = cJSON_GetObjectItem(c1, "logprobs");
    CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(l, "tokens")) == 2);
    cJSON *top0 = cJSON_GetArrayItem(cJSON_GetObjectItem(l, "top_logprobs"), 0);
    CHECK(cJSON_GetArraySize(top0) == 2 && cJSON_GetObjectItem(top0, " b")->valuedouble == -9999.0);
    CHECK(cJSON_IsNull(cJSON_GetArrayItem(cJSON_GetObjectItem(l, "token_logprobs"), 1)));
    CHECK(cJSON_GetArrayItem(cJSON_GetObjectItem(l, "text_offset"), 1)->valuedouble == 2);
    cJSON *u = cJSON_GetObjectItem(j, "usage");
    CHECK(cJSON_GetObjectItem(u, "prompt_tokens")->valuedouble == 5 &&
          cJSON_GetObjectItem(u, "completion_tokens")->valuedouble == 7 &&
          cJSON_GetObjectItem(u, "total_tokens")->valuedouble == 12);
    CHECK(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "kv_transfer_params"), "k")->valuedouble == 1);
    cJSON_Delete(j);
    free(body);
    body = completion_response_json(&m, cv, 1, 1, 1, NULL, NULL);
    j = cJSON_Parse(body);
    CHECK(j && cJSON_IsNull(cJSON_GetObjectItem(j, "kv_transfer_params")));
    cJSON_Delete(j);
    free(body);

    long long usage[2] = {3, 4};
    char *ev = completion_chunk_sse(&m, &cv[1], usage, &len);
    CHECK(ev && !strncmp(ev, "data: ", 6) && len > 8 && !strcmp(ev + len - 2, "\n\n"));
    j = cJSON_Parse(ev + 6);
    CHECK(j && cJSON_GetArraySize(cJSON_GetObjectItem(j, "choices")) == 1);
    CHECK(j &&
          cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "total_tokens")->valuedouble == 7);
    cJSON_Delete(j);
    free(ev);
    ev = completion_usage_sse(&m, 3, 4, &len);
    j = cJSON_Parse(ev + 6);
    CHECK(j && cJSON_GetArraySize(cJSON_GetObjectItem(j, "choices")) == 0 &&
          cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "completion_tokens")->valuedouble ==
              4);
    cJSON_Delete(j);
    free(ev);
    lp_list_clear(&lp);

    api_error e;
    api_fail(&e, 413, NULL, "too big: %d", 5);
    body = api_error_json(&e, NULL);
    j = cJSON_Parse(body);
    cJSON *eo = cJSON_GetObjectItem(j, "error");
    CHECK(eo && cJSON_GetObjectItem(eo, "code")->valuedouble == 413 &&
          cJSON_IsNull(cJSON_GetObjectItem(eo, "param")) &&
          !strcmp(cJSON_GetObjectItem(eo, "message")->valuestring, "too big: 5") &&
          cJSON_IsString(cJSON_GetObjectItem(eo, "type")));
    cJSON_Delete(j);
    free(body);
    char id[40];
    completion_make_id(id, 0xabcdefULL, 1);
    CHECK(strlen(id) == 37 && !strncmp(id, "cmpl-", 5));
}

/* Find the value of a sample line `name{labels...} value` in Prometheus text. */
static double prom_value(const char *text, const char *prefix) {
    const char *p = strstr(text, prefix);
    if (!p) return NAN;
    p = strchr(p, '}');
    return p ? strtod(p + 2, NULL) : NAN;
}

static void test_metrics(void) {
    metrics *m = metrics_create("my \"model\"", 2048);
    double values[] = {0.0005, 0.003, 0.02, 0.02, 0.3, 3000.0};
    double sum = 0;
    for (int i = 0; i < 6; i++) {
        metrics_request r = {.reason = i % 2 ? FINISH_LENGTH : FINISH_STOP,
                             .prompt_tokens = 1 + i * 300,
                             .generation_tokens = i,
                             .queue_time = -1,
                             .ttft = values[i],
                             .e2e = 1,
                             .tpot = -1};
        metrics_observe(m, &r);
        sum += values[i];
    }
    metrics_request ab = {
        .reason = FINISH_ABORT, .ttft = -1, .e2e = -1, .tpot = -1, .queue_time = -1};
    metrics_observe(m, &ab);
    engine_stats st = {.running = 3,
                       .waiting = 2,
                       .kv_usage = 0.25,
                       .prompt_tokens = 100,
                       .generation_tokens = 55,
                       .prefix_hits = 7,
                       .preemptions = 1};
    char *text = metrics_render(m, &st, NULL);
    CHECK(text != NULL);
    const char *lab = "{model_name=\"my \\\"model\\\"\",engine=\"0\"";
    char key[256];
    snprintf(key, sizeof key, "vllm:num_requests_running%s", lab);
    CHECK(prom_value(text, key) == 3);
    snprintf(key, sizeof key, "vllm:generation_tokens_total%s", lab);
    CHECK(prom_value(text, key) == 55);
    CHECK(strstr(text, "# TYPE vllm:prompt_tokens_total counter") != NULL);
    CHECK(prom_value(text, "vllm:request_success_total{model_name=\"my "
                           "\\\"model\\\"\",engine=\"0\",finished_reason=\"stop\"") == 3);
    CHECK(prom_value(text, "finished_reason=\"abort\"") == 1);
    /* TTFT buckets: cumulative counts equal a count computed here for each le. */
    for (int b = 0; b < N_OF(ttft_buckets); b++) {
        int want = 0;
        for (int i = 0; i < 6; i++)
            want += values[i] <= ttft_buckets[b];
        char le[300];
        pd_buf x;
        pd_buf_init(&x);
        prom_num(&x, ttft_buckets[b]);
        snprintf(le, sizeof le, "vllm:time_to_first_token_seconds_bucket%s,le=\"%s\"}", lab,
                 x.data);
        pd_buf_free(&x);
        const char *p = strstr(text, le);
        CHECKF(p && strtod(p + strlen(le) + 1, NULL) == want, "bucket %s want %d", le, want);
    }
    snprintf(key, sizeof key, "vllm:time_to_first_token_seconds_bucket%s,le=\"+Inf\"", lab);
    CHECK(prom_value(text, key) == 6);
    snprintf(key, sizeof key, "vllm:time_to_first_token_seconds_count%s", lab);
    CHECK(prom_value(text, key) == 6);
    snprintf(key, sizeof key, "vllm:time_to_first_token_seconds_sum%s", lab);
    CHECK(fabs(prom_value(text, key) - sum) < 1e-9);
    /* Token-count buckets are 1, 2, 5, ... up to max_model_len. */
    CHECK(strstr(text, "vllm:request_prompt_tokens_bucket{model_name=\"my "
                       "\\\"model\\\"\",engine=\"0\",le=\"2000.0\"}") != NULL);
    CHECK(strstr(text, "le=\"5000.0\"") == NULL);
    CHECK(metrics_finished(m, FINISH_LENGTH) == 3);
    free(text);
    metrics_free(m);
}

static int serve_parse(serve_options *o, pd_err *err, int argc, char **argv) {
    return serve_options_parse(argc, argv, o, err);
}

static void test_serve_options(void) {
    serve_options o;
    pd_err err;
    char *a1[] = {"/models/opt",
                  "--max_model_len",
                  "1k",
                  "--port=9001",
                  "--no-enable-prefix-caching",
                  "--served-model-name",
                  "a",
                  "b",
                  "--seed",
                  "7",
                  "--enforce-eager"};
    CHECKF(serve_parse(&o, &err, 11, a1) == 0, "%s", err.msg);
    CHECK(o.max_model_len_value == 1000 && o.port == 9001 && !o.enable_prefix_caching);
    CHECK(o.n_names == 2 && !strcmp(o.names[0], "a") && !strcmp(o.names[1], "b"));
    CHECK(o.model_arg && !strcmp(o.model_arg, "/models/opt") && o.seed == 7 && o.enforce_eager);
    CHECK(o.max_num_seqs == 256 && o.max_num_batched_tokens == 2048 && o.block_size == 16 &&
          o.max_logprobs == 20);
    engine_config c;
    memset(&c, 0, sizeof c);
    serve_options_to_engine(&o, "/dir", &c);
    CHECK(c.max_model_len == 1000 && !c.enable_prefix_caching && c.seed == 7 &&
          !strcmp(c.model_dir, "/dir") && c.max_num_seqs == 256);
    char *a2[] = {"--max-model-len", "1K", "--num-gpu-blocks-override", "12", "--max-waiting", "3"};
    CHECK(serve_parse(&o, &err, 6, a2) == 0 && o.max_model_len_value == 1024 && !o.model_arg);
    serve_options_to_engine(&o, "/dir", &c);
    CHECK(c.num_blocks_override == 12 && c.max_waiting == 3 && c.enable_prefix_caching);
    char *a3[] = {"--bogus-flag", "1"};
    CHECK(serve_parse(&o, &err, 2, a3) == -1 && strstr(err.msg, "--bogus-flag"));
    char *a4[] = {"--max-model-len", "12q"};
    CHECK(serve_parse(&o, &err, 2, a4) == -1 && strstr(err.msg, "max-model-len"));
    char *a5[] = {"--block-size", "12"};
    CHECK(serve_parse(&o, &err, 2, a5) == -1 && strstr(err.msg, "block-size"));
    char *a6[] = {"--dtype", "float8"};
    CHECK(serve_parse(&o, &err, 2, a6) == -1 && strstr(err.msg, "dtype"));
    char *a7[] = {"--tensor-parallel-size", "2"};
    CHECK(serve_parse(&o, &err, 2, a7) == -1 && strstr(err.msg, "tensor-parallel-size"));
    char *a8[] = {"--kv-transfer-config",
                  "{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_producer\",\"kv_port\":"
                  "21001,\"kv_buffer_size\":\"1e9\",\"kv_connector_extra_config\":{}}"};
    CHECKF(serve_parse(&o, &err, 2, a8) == 0, "%s", err.msg);
    struct {
        const char *json, *key;
    } kv_bad[] = {
        {"{not json", "JSON"},
        {"[1]", "object"},
        {"{\"kv_role\":\"kv_producer\"}", "kv_connector"},
        {"{\"kv_connector\":\"Nixl\",\"kv_role\":\"kv_producer\"}", "kv_connector"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"prefill\"}", "kv_role"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_port\":\"x\"}",
         "kv_port"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_port\":70000}",
         "kv_port"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_ip\":5}", "kv_ip"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_buffer_size\":"
         "\"big\"}",
         "kv_buffer_size"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_"
         "config\":3}",
         "kv_connector_extra_config"},
    };
    for (size_t i = 0; i < sizeof kv_bad / sizeof kv_bad[0]; i++) {
        char *a[] = {"--kv-transfer-config", (char *)kv_bad[i].json};
        CHECKF(serve_parse(&o, &err, 2, a) == -1 && strstr(err.msg, kv_bad[i].key),
               "kv config %s: %s", kv_bad[i].json, err.msg);
    }
    /* --device / --dtype: checked at parse time, the backend settled from the checkpoint. */
    char *a9[] = {"--device", "cuda:2", "--dtype", "auto", "--gpu-memory-utilization", "0.5"};
    CHECKF(serve_parse(&o, &err, 6, a9) == 0, "%s", err.msg);
    CHECK(!strcmp(o.device_name, "cuda:2") && serve_options_given(&o, "gpu-memory-utilization") &&
          !serve_options_given(&o, "kv-cache-memory-bytes"));
    CHECKF(serve_options_select_backend(&o, PD_BF16, &err) == 0 &&
               !strcmp(o.backend, "cuda-bf16:2"),
           "%s", o.backend);
    serve_options_to_engine(&o, "/dir", &c);
    CHECK(c.backend && !strcmp(c.backend, "cuda-bf16:2") &&
          fabs(c.gpu_memory_utilization - 0.5) < 1e-6);
    CHECK(serve_options_select_backend(&o, PD_F32, &err) == 0 && !strcmp(o.backend, "cuda-fp16:2"));
    char *a10[] = {"--device", "tpu"};
    CHECK(serve_parse(&o, &err, 2, a10) == -1 && strstr(err.msg, "--device") &&
          strstr(err.msg, "tpu"));
    char *a11[] = {"--device", "cuda:"};
    CHECK(serve_parse(&o, &err, 2, a11) == -1 && strstr(err.msg, "cuda:"));
    char *a12[] = {"--gpu-memory-utilization", "1.5"};
    CHECK(serve_parse(&o, &err, 2, a12) == -1 && strstr(err.msg, "gpu-memory-utilization"));
    char *a13[] = {"--dtype", "bf16"};
    CHECK(serve_parse(&o, &err, 2, a13) == 0 && !strcmp(o.device_name, "cpu"));
    CHECK(serve_options_select_backend(&o, PD_BF16, &err) == 0 && !strcmp(o.backend, "cpu"));
    /* The in-process commands take the engine flags but no HTTP ones. */
    char *a14[] = {"m", "--max-num-seqs", "8", "--enforce-eager", "--device", "cpu"};
    CHECKF(serve_options_parse_engine(6, a14, &o, &err) == 0 && o.max_num_seqs == 8, "%s", err.msg);
    char *a15[] = {"m", "--port", "9000"};
    CHECK(serve_options_parse_engine(3, a15, &o, &err) == -1 && strstr(err.msg, "--port"));
    char *a16[] = {"--api-key=k"};
    CHECK(serve_options_parse_engine(1, a16, &o, &err) == -1 && strstr(err.msg, "--api-key"));

    int v;
    CHECK(serve_parse_max_model_len("auto", &v, &err) == 0 && v == 0);
    CHECK(serve_parse_max_model_len("2048", &v, &err) == 0 && v == 2048);
    CHECK(serve_parse_max_model_len("-5", &v, &err) == -1);
}

/* The --dtype rule on each device, for each checkpoint dtype (vLLM's auto:
 * bf16 stays bf16, fp32 and fp16 run in fp16 on CUDA; the CPU is fp32). */
static void test_device_dtype(void) {
    static const struct {
        const char *device, *dtype;
        pd_dtype ckpt;
        const char *backend;
    } cases[] = {
        {"cpu", "auto", PD_F32, "cpu"},
        {"cpu", "auto", PD_BF16, "cpu"},
        {"cpu", "float16", PD_F16, "cpu"},
        {"cuda", "auto", PD_F32, "cuda-fp16"},
        {"cuda", "auto", PD_F16, "cuda-fp16"},
        {"cuda", "auto", PD_BF16, "cuda-bf16"},
        {"cuda", "float32", PD_BF16, "cuda"},
        {"cuda", "float", PD_F16, "cuda"},
        {"cuda", "half", PD_BF16, "cuda-fp16"},
        {"cuda", "bfloat16", PD_F32, "cuda-bf16"},
        {"cuda:3", "auto", PD_F32, "cuda-fp16:3"},
        {"cuda:3", "fp32", PD_F32, "cuda:3"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char dev[24], name[48];
        pd_err err = {{0}};
        CHECKF(device_flags_check(cases[i].device, cases[i].dtype, dev, sizeof dev, &err) == 0,
               "%s", err.msg);
        CHECKF(device_select_backend(dev, cases[i].dtype, cases[i].ckpt, name, sizeof name, &err) ==
                       0 &&
                   !strcmp(name, cases[i].backend),
               "%s --dtype %s, checkpoint %s: got %s, want %s", cases[i].device, cases[i].dtype,
               pd_dtype_name(cases[i].ckpt), name, cases[i].backend);
    }
    char dev[24];
    pd_err err = {{0}};
    CHECK(device_flags_check("cpu", "int8", dev, sizeof dev, &err) == -1 &&
          strstr(err.msg, "int8"));
    CHECK(device_flags_check("cuda:1:2", "auto", dev, sizeof dev, &err) == -1);
    CHECK(device_flags_check("auto", "auto", dev, sizeof dev, &err) == 0 &&
          (!strcmp(dev, "cpu") || !strcmp(dev, "cuda")));
}

int main(void) {
    api_limits_default(&LIM);
    pd_log_set_level(PD_LOG_ERROR);
    test_json_strings();
    test_parse_forms();
    test_parse_errors();
    test_check_prompt();
    test_stop_strings();
    test_utf8_boundary();
    test_responses();
    test_metrics();
    test_serve_options();
    test_device_dtype();
    return test_finish();
}
