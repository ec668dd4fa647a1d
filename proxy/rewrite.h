/* rewrite: the JSON bodies of the three hops (docs/protocol.md, "HTTP flow")
 * and the proxy's OpenAI-style errors.
 *  - prefill body: the client's body with max_tokens 1 (and
 *    max_completion_tokens 1 when present), stream false, no stream_options,
 *    no min_tokens (it could exceed 1), and
 *    kv_transfer_params {"do_remote_decode": true, "remote_kv_addr": D_KV}.
 *  - decode body: the client's original bytes plus the prefill's
 *    kv_transfer_params unchanged (or without any when the prefill returned
 *    none). The bytes are kept as the client sent them where possible, so
 *    numbers such as big seeds are not re-printed. */
#ifndef PD_PROXY_REWRITE_H
#define PD_PROXY_REWRITE_H

#include <cjson/cJSON.h>
#include <stddef.h>

/* root: the parsed client body (a JSON object). New buffer, or NULL (out of memory). */
char *rewrite_prefill_body(const cJSON *root, const char *remote_kv_addr, size_t *len);
/* params: compact JSON of an object, or NULL. New buffer, or NULL. */
char *rewrite_decode_body(const char *orig, size_t orig_len, const cJSON *root, const char *params,
                          size_t *len);
/* From the prefill's answer: 0 and *params (compact JSON, caller frees; NULL
 * when absent or null), or -1 when the answer is not a JSON object or its
 * kv_transfer_params is neither an object nor null. */
int rewrite_prefill_answer(const char *body, size_t len, char **params);

/* OpenAI error type for a status ("BadGatewayError", ...). */
const char *rewrite_error_type(int status);
/* {"error":{"message":..,"type":..,"param":null,"code":status}} — new buffer. */
char *rewrite_error_json(int status, const char *message, size_t *len);
/* The message of an OpenAI error body ({"error":{"message":..}} or
 * {"error":".."}) into msg, and its param (empty when none) into param;
 * 0, or -1 when body is no such error. */
int rewrite_error_message(const char *body, size_t len, char *msg, size_t cap, char *param,
                          size_t pcap);
/* An instance's error answer, its message prefixed with who said it; when
 * the body is not an OpenAI error, a new one saying the status. */
char *rewrite_upstream_error(const char *body, size_t len, int status, const char *who,
                             size_t *out_len);

#endif
