/* rewrite: hop bodies and error JSON. See rewrite.h. */
#include "proxy/rewrite.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pd_buf.h"

char *rewrite_prefill_body(const cJSON *root, const char *remote_kv_addr, size_t *len) {
    cJSON *b = cJSON_Duplicate(root, 1);
    if (!b) return NULL;
    cJSON_DeleteItemFromObjectCaseSensitive(b, "max_tokens");
    cJSON_AddNumberToObject(b, "max_tokens", 1);
    if (cJSON_GetObjectItemCaseSensitive(b, "max_completion_tokens")) {
        cJSON_DeleteItemFromObjectCaseSensitive(b, "max_completion_tokens");
        cJSON_AddNumberToObject(b, "max_completion_tokens", 1);
    }
    cJSON_DeleteItemFromObjectCaseSensitive(b, "stream");
    cJSON_AddFalseToObject(b, "stream");
    cJSON_DeleteItemFromObjectCaseSensitive(b, "stream_options");
    cJSON_DeleteItemFromObjectCaseSensitive(b, "min_tokens");
    cJSON_DeleteItemFromObjectCaseSensitive(b, "kv_transfer_params");
    cJSON *kv = cJSON_AddObjectToObject(b, "kv_transfer_params");
    if (kv) {
        cJSON_AddTrueToObject(kv, "do_remote_decode");
        cJSON_AddStringToObject(kv, "remote_kv_addr", remote_kv_addr);
    }
    char *out = kv ? cJSON_PrintUnformatted(b) : NULL;
    cJSON_Delete(b);
    if (out && len) *len = strlen(out);
    return out;
}

char *rewrite_decode_body(const char *orig, size_t orig_len, const cJSON *root, const char *params,
                          size_t *len) {
    pd_buf b;
    pd_buf_init(&b);
    if (!cJSON_GetObjectItemCaseSensitive(root, "kv_transfer_params")) {
        if (!params) {
            pd_buf_append(&b, orig, orig_len);
            return pd_buf_take(&b, len);
        }
        /* Splice the field in before the object's closing brace. */
        size_t end = orig_len;
        while (end && orig[end - 1] != '}')
            end--;
        if (end) {
            size_t k = end - 1;
            while (k && (orig[k - 1] == ' ' || orig[k - 1] == '\n' || orig[k - 1] == '\r' ||
                         orig[k - 1] == '\t'))
                k--;
            bool empty = k && orig[k - 1] == '{';
            pd_buf_append(&b, orig, end - 1);
            pd_buf_puts(&b, empty ? "\"kv_transfer_params\":" : ",\"kv_transfer_params\":");
            pd_buf_puts(&b, params);
            pd_buf_puts(&b, "}");
            return pd_buf_take(&b, len);
        }
    }
    /* The client sent its own kv_transfer_params: the proxy's replace them. */
    cJSON *d = cJSON_Duplicate(root, 1);
    if (!d) return NULL;
    cJSON_DeleteItemFromObjectCaseSensitive(d, "kv_transfer_params");
    if (params) {
        cJSON *p = cJSON_Parse(params);
        if (p) cJSON_AddItemToObject(d, "kv_transfer_params", p);
    }
    char *out = cJSON_PrintUnformatted(d);
    cJSON_Delete(d);
    if (out && len) *len = strlen(out);
    return out;
}

int rewrite_prefill_answer(const char *body, size_t len, char **params) {
    *params = NULL;
    cJSON *root = cJSON_ParseWithLength(body, len);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return -1;
    }
    int rc = 0;
    const cJSON *kv = cJSON_GetObjectItemCaseSensitive(root, "kv_transfer_params");
    if (kv && cJSON_IsObject(kv)) {
        *params = cJSON_PrintUnformatted(kv);
        if (!*params) rc = -1;
    } else if (kv && !cJSON_IsNull(kv)) {
        rc = -1;
    }
    cJSON_Delete(root);
    return rc;
}

const char *rewrite_error_type(int status) {
    switch (status) {
    case 400:
        return "BadRequestError";
    case 401:
        return "AuthenticationError";
    case 404:
        return "NotFoundError";
    case 405:
        return "MethodNotAllowedError";
    case 413:
        return "RequestEntityTooLargeError";
    case 502:
        return "BadGatewayError";
    case 503:
        return "ServiceUnavailableError";
    case 504:
        return "GatewayTimeoutError";
    default:
        return status >= 500 ? "InternalServerError" : "BadRequestError";
    }
}

static char *error_json(int status, const char *type, const char *message, const cJSON *param,
                        size_t *len) {
    pd_buf b;
    pd_buf_init(&b);
    pd_buf_puts(&b, "{\"error\":{\"message\":");
    pd_buf_json_str(&b, message);
    pd_buf_puts(&b, ",\"type\":");
    pd_buf_json_str(&b, type);
    pd_buf_puts(&b, ",\"param\":");
    if (param && cJSON_IsString(param))
        pd_buf_json_str(&b, param->valuestring);
    else
        pd_buf_puts(&b, "null");
    pd_buf_printf(&b, ",\"code\":%d}}", status);
    return pd_buf_take(&b, len);
}

char *rewrite_error_json(int status, const char *message, size_t *len) {
    return error_json(status, rewrite_error_type(status), message, NULL, len);
}

/* The parts of a parsed OpenAI error body ({"error":{"message",..}} or
 * {"error":".."}): its message text (NULL when it is no such error), and
 * its type and param items (NULL when absent). */
static const char *error_parts(const cJSON *root, const cJSON **type, const cJSON **param) {
    const cJSON *e = root ? cJSON_GetObjectItemCaseSensitive(root, "error") : NULL;
    const cJSON *msg = e ? cJSON_GetObjectItemCaseSensitive(e, "message") : NULL;
    *type = e ? cJSON_GetObjectItemCaseSensitive(e, "type") : NULL;
    *param = e ? cJSON_GetObjectItemCaseSensitive(e, "param") : NULL;
    return cJSON_IsString(msg) ? msg->valuestring : cJSON_IsString(e) ? e->valuestring : NULL;
}

int rewrite_error_message(const char *body, size_t len, char *out, size_t cap, char *param,
                          size_t pcap) {
    cJSON *root = body ? cJSON_ParseWithLength(body, len) : NULL;
    const cJSON *type, *par;
    const char *text = error_parts(root, &type, &par);
    if (text) snprintf(out, cap, "%s", text);
    if (pcap) snprintf(param, pcap, "%s", cJSON_IsString(par) ? par->valuestring : "");
    cJSON_Delete(root);
    return text ? 0 : -1;
}

char *rewrite_upstream_error(const char *body, size_t len, int status, const char *who,
                             size_t *out_len) {
    cJSON *root = cJSON_ParseWithLength(body, len);
    const cJSON *type, *param;
    const char *said = error_parts(root, &type, &param);
    pd_buf m;
    pd_buf_init(&m);
    if (said)
        pd_buf_printf(&m, "%s: %s", who, said);
    else
        pd_buf_printf(&m, "%s answered HTTP %d", who, status);
    char *text = pd_buf_take(&m, NULL);
    char *out =
        text ? error_json(status,
                          cJSON_IsString(type) ? type->valuestring : rewrite_error_type(status),
                          text, param, out_len)
             : NULL;
    free(text);
    cJSON_Delete(root);
    return out;
}
