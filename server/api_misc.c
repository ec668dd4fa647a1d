/* api_misc: the small endpoints — /v1/models, /health, /version, /tokenize,
 * /detokenize, /metrics, and /v1/chat/completions, which for OPT (no chat
 * template) answers vLLM's 400. */
#include <cjson/cJSON.h>
#include <microhttpd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/tokenizer.h"
#include "server/api_json.h"
#include "server/http.h"

static void reply_json(http_reply *out, unsigned status, pd_buf *b) {
    size_t len;
    char *body = pd_buf_take(b, &len);
    if (!body) {
        api_error e;
        api_fail(&e, 500, NULL, "out of memory");
        return http_reply_error(out, &e);
    }
    http_reply_body(out, status, "application/json", body, len);
}

void api_health(http_request *rq, http_reply *out) {
    /* The engine has no failure state of its own to report; a draining
     * server is the one "not healthy" case. */
    http_reply_body(out, atomic_load(&rq->ctx->draining) ? 503 : 200, NULL, NULL, 0);
}

void api_version(http_request *rq, http_reply *out) {
    (void)rq;
    pd_buf b;
    pd_buf_init(&b);
    pd_buf_puts(&b, "{\"version\":\"" PDSERVE_VERSION "\"}");
    reply_json(out, 200, &b);
}

void api_models(http_request *rq, http_reply *out) {
    http_ctx *ctx = rq->ctx;
    pd_buf b;
    pd_buf_init(&b);
    pd_buf_puts(&b, "{\"object\":\"list\",\"data\":[");
    for (int i = 0; i < ctx->cfg.n_names; i++) {
        if (i) pd_buf_puts(&b, ",");
        pd_buf_puts(&b, "{\"id\":");
        jb_cstr(&b, ctx->cfg.names[i]);
        pd_buf_printf(&b,
                      ",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"pdserve\",\"root\":",
                      ctx->started);
        jb_cstr(&b, ctx->cfg.model_root);
        pd_buf_printf(&b, ",\"parent\":null,\"max_model_len\":%d,\"permission\":[{\"id\":",
                      engine_max_model_len(ctx->eng));
        char id[40];
        http_new_completion_id(ctx, id);
        pd_buf_printf(&b, "\"modelperm-%s\"", id + 5);
        pd_buf_printf(&b,
                      ",\"object\":\"model_permission\",\"created\":%lld,"
                      "\"allow_create_engine\":false,\"allow_sampling\":true,"
                      "\"allow_logprobs\":true,\"allow_search_indices\":false,"
                      "\"allow_view\":true,\"allow_fine_tuning\":false,\"organization\":\"*\","
                      "\"group\":null,\"is_blocking\":false}]}",
                      ctx->started);
    }
    pd_buf_puts(&b, "]}");
    reply_json(out, 200, &b);
}

void api_metrics(http_request *rq, http_reply *out) {
    engine_stats st;
    engine_stats_get(rq->ctx->eng, &st);
    size_t len;
    char *body = metrics_render(rq->ctx->met, &st, &len);
    http_reply_body(out, 200, "text/plain; version=0.0.4; charset=utf-8", body, len);
}

static const char *chat_template_message =
    "As of transformers v4.44, default chat template is no longer allowed, so you must provide "
    "a chat template if the tokenizer does not define one.";

/* Parse the body as a JSON object and check its model; NULL after replying an error. */
static cJSON *parse_body(http_request *rq, http_reply *out) {
    api_error e;
    cJSON *root = cJSON_ParseWithLength(rq->body, rq->body_len);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        api_fail(&e, 400, NULL, "the request body must be a JSON object");
        http_reply_error(out, &e);
        return NULL;
    }
    cJSON *m = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (m && !cJSON_IsNull(m) && !cJSON_IsString(m)) {
        api_fail(&e, 400, "model", "model: Input should be a string");
    } else if (cJSON_IsString(m) && m->valuestring[0] &&
               http_check_model(rq->ctx, m->valuestring, &e) != 0) {
    } else {
        return root;
    }
    cJSON_Delete(root);
    http_reply_error(out, &e);
    return NULL;
}

void api_chat_completions(http_request *rq, http_reply *out) {
    cJSON *root = parse_body(rq, out);
    if (!root) return;
    api_error e;
    cJSON *msgs = cJSON_GetObjectItemCaseSensitive(root, "messages");
    if (!cJSON_IsArray(msgs))
        api_fail(&e, 400, "messages", "messages: Field required (a list)");
    else
        api_fail(&e, 400, NULL, "%s", chat_template_message);
    cJSON_Delete(root);
    http_reply_error(out, &e);
}

static int get_bool_field(const cJSON *root, const char *name, bool *v, api_error *e) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(root, name);
    if (!x || cJSON_IsNull(x)) return 0;
    if (!cJSON_IsBool(x))
        return api_fail(e, 400, name, "%s: Input should be a valid boolean", name);
    *v = cJSON_IsTrue(x);
    return 0;
}

void api_tokenize(http_request *rq, http_reply *out) {
    cJSON *root = parse_body(rq, out);
    if (!root) return;
    api_error e;
    const tokenizer *tok = engine_tokenizer(rq->ctx->eng);
    bool add_special = true, strs = false;
    int32_t *ids = NULL;
    int n = 0;
    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    if (cJSON_GetObjectItemCaseSensitive(root, "messages")) {
        api_fail(&e, 400, NULL, "%s", chat_template_message);
        goto fail;
    }
    if (get_bool_field(root, "add_special_tokens", &add_special, &e) != 0 ||
        get_bool_field(root, "return_token_strs", &strs, &e) != 0)
        goto fail;
    if (!cJSON_IsString(prompt)) {
        api_fail(&e, 400, "prompt", "prompt: Input should be a valid string");
        goto fail;
    }
    pd_err err;
    if (tokenizer_encode(tok, prompt->valuestring, strlen(prompt->valuestring), add_special, &ids,
                         &n, &err) != 0) {
        api_fail(&e, 400, "prompt", "%s", err.msg);
        goto fail;
    }
    pd_buf b;
    pd_buf_init(&b);
    pd_buf_printf(&b, "{\"count\":%d,\"max_model_len\":%d,\"tokens\":[", n,
                  engine_max_model_len(rq->ctx->eng));
    for (int i = 0; i < n; i++)
        pd_buf_printf(&b, "%s%d", i ? "," : "", ids[i]);
    pd_buf_puts(&b, "],\"token_strs\":");
    if (!strs) {
        pd_buf_puts(&b, "null");
    } else {
        pd_buf_puts(&b, "[");
        for (int i = 0; i < n; i++) {
            size_t len = 0;
            const char *bytes = tokenizer_token_bytes(tok, ids[i], &len);
            if (i) pd_buf_puts(&b, ",");
            jb_str(&b, bytes ? bytes : "", bytes ? len : 0);
        }
        pd_buf_puts(&b, "]");
    }
    pd_buf_puts(&b, "}");
    free(ids);
    cJSON_Delete(root);
    return reply_json(out, 200, &b);
fail:
    free(ids);
    cJSON_Delete(root);
    http_reply_error(out, &e);
}

void api_detokenize(http_request *rq, http_reply *out) {
    cJSON *root = parse_body(rq, out);
    if (!root) return;
    api_error e;
    int vocab = engine_model_config(rq->ctx->eng)->vocab_size;
    const cJSON *tokens = cJSON_GetObjectItemCaseSensitive(root, "tokens");
    int32_t *ids = NULL;
    if (!cJSON_IsArray(tokens)) {
        api_fail(&e, 400, "tokens", "tokens: Input should be a list of integers");
        goto fail;
    }
    int n = cJSON_GetArraySize(tokens), i = 0;
    ids = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    if (!ids) {
        api_fail(&e, 500, NULL, "out of memory");
        goto fail;
    }
    for (const cJSON *it = tokens->child; it; it = it->next, i++) {
        double d = cJSON_IsNumber(it) ? it->valuedouble : -1;
        if (!cJSON_IsNumber(it) || d != (double)(int64_t)d) {
            api_fail(&e, 400, "tokens", "tokens[%d] must be an integer token id", i);
            goto fail;
        }
        if (d < 0 || d >= vocab) {
            api_fail(&e, 400, "tokens", "tokens[%d]: Token id out of vocabulary (0..%d)", i,
                     vocab - 1);
            goto fail;
        }
        ids[i] = (int32_t)d;
    }
    size_t len = 0;
    char *text = tokenizer_decode(engine_tokenizer(rq->ctx->eng), ids, n, false, &len);
    pd_buf b;
    pd_buf_init(&b);
    pd_buf_puts(&b, "{\"prompt\":");
    jb_str(&b, text ? text : "", text ? len : 0);
    pd_buf_puts(&b, "}");
    free(text);
    free(ids);
    cJSON_Delete(root);
    return reply_json(out, 200, &b);
fail:
    free(ids);
    cJSON_Delete(root);
    http_reply_error(out, &e);
}
