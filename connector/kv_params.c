/* kv_params: parsing and validation of --kv-transfer-config (vLLM's keys)
 * and of a request's kv_transfer_params (protocol.md). See connector.h. */
#include "connector/connector.h"
#include "connector/p2p.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- --kv-transfer-config ---- */

const char *kv_role_name(kv_role r) {
    static const char *n[] = {"kv_producer", "kv_consumer", "kv_both"};
    return r <= KV_ROLE_BOTH ? n[r] : "?";
}

const char *kv_send_type_name(kv_send_type t) {
    static const char *n[] = {"PUT", "PUT_ASYNC", "GET"};
    return t <= KV_SEND_GET ? n[t] : "?";
}

/* A number given as JSON number or string ("5e9", "21001"), as vLLM's examples do. */
static int json_number(const cJSON *v, const char *key, double *out, pd_err *err) {
    if (cJSON_IsNumber(v)) {
        *out = v->valuedouble;
        return 0;
    }
    if (cJSON_IsString(v)) {
        char *end = NULL;
        double d = strtod(v->valuestring, &end);
        if (end != v->valuestring && *end == 0 && isfinite(d)) {
            *out = d;
            return 0;
        }
    }
    return pd_fail(err, "--kv-transfer-config: %s must be a number (or a string holding one)", key);
}

static int json_port(const cJSON *v, const char *key, int *out, pd_err *err) {
    double d = 0;
    if (json_number(v, key, &d, err) != 0) return -1;
    if (d != floor(d) || d < 1 || d > 65535)
        return pd_fail(err, "--kv-transfer-config: %s must be a port number in 1..65535, got %g", key, d);
    *out = (int)d;
    return 0;
}

static int json_string(const cJSON *v, const char *key, char *out, size_t cap, pd_err *err) {
    if (!cJSON_IsString(v) || strlen(v->valuestring) >= cap)
        return pd_fail(err, "--kv-transfer-config: %s must be a string (under %zu bytes)", key, cap);
    snprintf(out, cap, "%s", v->valuestring);
    return 0;
}

static int parse_extra(const cJSON *extra, kv_transfer_config *c, pd_err *err) {
    if (!cJSON_IsObject(extra)) return pd_fail(err, "--kv-transfer-config: kv_connector_extra_config must be an object");
    const cJSON *v;
    cJSON_ArrayForEach(v, extra) {
        const char *k = v->string;
        char tmp[32];
        double d = 0;
        if (!strcmp(k, "proxy_ip")) {
            if (json_string(v, "kv_connector_extra_config.proxy_ip", c->proxy_ip, sizeof c->proxy_ip, err)) return -1;
        } else if (!strcmp(k, "proxy_port")) {
            if (cJSON_IsString(v) && v->valuestring[0] == 0) c->proxy_port = 0; /* vLLM's "no proxy" */
            else if (json_port(v, "kv_connector_extra_config.proxy_port", &c->proxy_port, err)) return -1;
        } else if (!strcmp(k, "http_port")) {
            if (json_port(v, "kv_connector_extra_config.http_port", &c->http_port, err)) return -1;
        } else if (!strcmp(k, "send_type")) {
            if (json_string(v, "kv_connector_extra_config.send_type", tmp, sizeof tmp, err)) return -1;
            if (!strcmp(tmp, "PUT")) c->send_type = KV_SEND_PUT;
            else if (!strcmp(tmp, "PUT_ASYNC")) c->send_type = KV_SEND_PUT_ASYNC;
            else if (!strcmp(tmp, "GET")) c->send_type = KV_SEND_GET;
            else return pd_fail(err, "--kv-transfer-config: kv_connector_extra_config.send_type must be PUT, PUT_ASYNC or GET, got '%s'", tmp);
        } else if (!strcmp(k, "transport")) {
            if (json_string(v, "kv_connector_extra_config.transport", tmp, sizeof tmp, err)) return -1;
            if (!strcmp(tmp, "tcp")) c->transport = KV_TRANSPORT_TCP;
            else if (!strcmp(tmp, "nccl")) c->transport = KV_TRANSPORT_NCCL;
            else return pd_fail(err, "--kv-transfer-config: kv_connector_extra_config.transport must be tcp or nccl, got '%s'", tmp);
        } else if (!strcmp(k, "nccl_num_channels")) {
            if (json_number(v, "kv_connector_extra_config.nccl_num_channels", &d, err)) return -1;
            if (d < 1 || d > 64 || d != floor(d))
                return pd_fail(err, "--kv-transfer-config: kv_connector_extra_config.nccl_num_channels must be 1..64, got %g", d);
            c->nccl_num_channels = (int)d;
        } else if (!strcmp(k, "timeout_s") || !strcmp(k, "announce_interval_s")) {
            if (json_number(v, k, &d, err)) return -1;
            if (!(d > 0 && d <= 3600)) return pd_fail(err, "--kv-transfer-config: kv_connector_extra_config.%s must be in (0, 3600], got %g", k, d);
            if (k[0] == 't') c->timeout_s = d;
            else c->announce_interval_s = d;
        } else if (!strcmp(k, "recv_into_pinned")) {
            if (!cJSON_IsBool(v))
                return pd_fail(err,
                               "--kv-transfer-config: kv_connector_extra_config.recv_into_pinned "
                               "must be true or false");
            c->recv_into_pinned = cJSON_IsTrue(v);
        } else if (!strcmp(k, "tcp_streams")) {
            if (json_number(v, "kv_connector_extra_config.tcp_streams", &d, err)) return -1;
            if (d < 1 || d > P2P_MAX_STREAMS || d != floor(d))
                return pd_fail(err,
                               "--kv-transfer-config: kv_connector_extra_config.tcp_streams must "
                               "be 1..%d, got %g",
                               P2P_MAX_STREAMS, d);
            c->tcp_streams = (int)d;
        } else if (!strcmp(k, "mem_pool_size_gb")) {
            if (json_number(v, "kv_connector_extra_config.mem_pool_size_gb", &d, err)) return -1;
            if (!(d > 0 && d <= 1024))
                return pd_fail(err,
                               "--kv-transfer-config: kv_connector_extra_config.mem_pool_size_gb "
                               "must be in (0, 1024], got %g",
                               d);
            c->mem_pool_size_gb = d;
        } else {
            pd_log(PD_LOG_WARN, "kv-transfer-config: unknown key kv_connector_extra_config.%s ignored", k);
        }
    }
    return 0;
}

int kv_transfer_config_parse(const char *json, kv_transfer_config *c, pd_err *err) {
    memset(c, 0, sizeof *c);
    c->kv_port = 14579;
    c->kv_buffer_size = 1e9;
    c->send_type = KV_SEND_PUT_ASYNC;
    c->transport = KV_TRANSPORT_TCP;
    c->nccl_num_channels = 8;
    c->timeout_s = 30;
    c->announce_interval_s = 3;
    c->mem_pool_size_gb = 1;
    c->tcp_streams = 1;
    cJSON *root = cJSON_Parse(json);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return pd_fail(err, "--kv-transfer-config: not a JSON object");
    }
    int rc = -1;
    /* A key given twice counts as its last value, as Python's json (vLLM)
     * reads it, and as every other key here is read. */
    const cJSON *conn = NULL, *role = NULL, *it;
    cJSON_ArrayForEach(it, root) {
        if (!strcmp(it->string, "kv_connector")) conn = it;
        if (!strcmp(it->string, "kv_role")) role = it;
    }
    if (!cJSON_IsString(conn)) {
        pd_fail(err, "--kv-transfer-config: kv_connector is required (\"P2pNcclConnector\")");
        goto out;
    }
    if (strcmp(conn->valuestring, "P2pNcclConnector") != 0) {
        pd_fail(err, "--kv-transfer-config: kv_connector '%s' is not supported (only P2pNcclConnector)", conn->valuestring);
        goto out;
    }
    if (!cJSON_IsString(role)) {
        pd_fail(err, "--kv-transfer-config: kv_role is required (kv_producer, kv_consumer or kv_both)");
        goto out;
    }
    if (!strcmp(role->valuestring, "kv_producer")) c->role = KV_ROLE_PRODUCER;
    else if (!strcmp(role->valuestring, "kv_consumer")) c->role = KV_ROLE_CONSUMER;
    else if (!strcmp(role->valuestring, "kv_both")) c->role = KV_ROLE_BOTH;
    else {
        pd_fail(err, "--kv-transfer-config: kv_role must be kv_producer, kv_consumer or kv_both, got '%s'", role->valuestring);
        goto out;
    }
    const cJSON *v;
    cJSON_ArrayForEach(v, root) {
        const char *k = v->string;
        if (!strcmp(k, "kv_connector") || !strcmp(k, "kv_role")) continue;
        if (!strcmp(k, "kv_port")) {
            if (json_port(v, "kv_port", &c->kv_port, err)) goto out;
        } else if (!strcmp(k, "kv_ip")) {
            if (json_string(v, "kv_ip", c->kv_ip, sizeof c->kv_ip, err)) goto out;
        } else if (!strcmp(k, "kv_buffer_size")) {
            if (json_number(v, "kv_buffer_size", &c->kv_buffer_size, err)) goto out;
            if (!(c->kv_buffer_size > 0) || c->kv_buffer_size > 1e15) {
                pd_fail(err,
                        "--kv-transfer-config: kv_buffer_size must be a byte count in (0, 1e15], "
                        "got %g",
                        c->kv_buffer_size);
                goto out;
            }
        } else if (!strcmp(k, "kv_connector_extra_config")) {
            if (parse_extra(v, c, err)) goto out;
        } else if (!strcmp(k, "kv_load_failure_policy")) {
            const char *pol = cJSON_IsString(v) ? v->valuestring : NULL;
            if (!pol || (strcmp(pol, "fail") != 0 && strcmp(pol, "recompute") != 0)) {
                char *got = cJSON_PrintUnformatted(v);
                pd_fail(err,
                        "--kv-transfer-config: kv_load_failure_policy must be \"fail\" or "
                        "\"recompute\", got %.60s",
                        got ? got : "?");
                cJSON_free(got);
                goto out;
            }
            c->recompute_on_load_failure = !strcmp(pol, "recompute");
        } else if (!strcmp(k, "kv_rank") || !strcmp(k, "kv_parallel_size") ||
                   !strcmp(k, "kv_buffer_device") || !strcmp(k, "engine_id") ||
                   !strcmp(k, "kv_connector_module_path")) {
            pd_log(PD_LOG_INFO, "kv-transfer-config: %s is accepted and ignored (one device per instance)", k);
        } else {
            pd_log(PD_LOG_WARN, "kv-transfer-config: unknown key %s ignored", k);
        }
    }
    if (c->proxy_ip[0] && !c->proxy_port) {
        /* vLLM announces only when both are set, and starts all the same. */
        pd_log(PD_LOG_WARN,
               "kv_connector_extra_config has proxy_ip %s but no proxy_port: this "
               "instance announces itself to no proxy",
               c->proxy_ip);
        c->proxy_ip[0] = 0;
    }
    rc = 0;
out:
    cJSON_Delete(root);
    return rc;
}

/* ---- kv_transfer_params ---- */

/* "host:port" with a plausible host and a port in range. */
static bool valid_host_port(const char *s) {
    const char *colon = strrchr(s, ':');
    if (!colon || colon == s || colon - s > 100) return false;
    for (const char *p = s; p < colon; p++)
        if (!(isalnum((unsigned char)*p) || *p == '.' || *p == '-' || *p == '_' || *p == '[' || *p == ']' || *p == ':'))
            return false;
    char *end;
    long port = strtol(colon + 1, &end, 10);
    return *end == 0 && end != colon + 1 && port >= 1 && port <= 65535;
}

int kv_request_params_parse(const char *json, kv_request_params *out, pd_err *err) {
    memset(out, 0, sizeof *out);
    if (!json || !strcmp(json, "null")) return 0;
    cJSON *root = cJSON_Parse(json);
    int rc = -1;
    if (!cJSON_IsObject(root)) {
        pd_fail(err, "kv_transfer_params must be an object");
        goto out;
    }
    const cJSON *v;
    cJSON_ArrayForEach(v, root) {
        const char *k = v->string;
        if (!strcmp(k, "do_remote_decode") || !strcmp(k, "do_remote_prefill")) {
            if (cJSON_IsNull(v)) continue;
            if (!cJSON_IsBool(v)) {
                pd_fail(err, "kv_transfer_params.%s must be a boolean", k);
                goto out;
            }
            if (k[10] == 'd') out->do_remote_decode = cJSON_IsTrue(v);
            else out->do_remote_prefill = cJSON_IsTrue(v);
        } else if (!strcmp(k, "remote_kv_addr")) {
            if (cJSON_IsNull(v)) continue;
            if (!cJSON_IsString(v) || strlen(v->valuestring) >= sizeof out->remote_kv_addr ||
                !valid_host_port(v->valuestring)) {
                pd_fail(err, "kv_transfer_params.remote_kv_addr must be a \"host:port\" string");
                goto out;
            }
            snprintf(out->remote_kv_addr, sizeof out->remote_kv_addr, "%s", v->valuestring);
        } else if (!strcmp(k, "remote_request_id")) {
            if (cJSON_IsNull(v)) continue;
            if (!cJSON_IsString(v) || !v->valuestring[0] || strlen(v->valuestring) >= sizeof out->remote_request_id ||
                strchr(v->valuestring, '#')) {
                pd_fail(err, "kv_transfer_params.remote_request_id must be a non-empty string without '#' (under %zu bytes)",
                        sizeof out->remote_request_id);
                goto out;
            }
            snprintf(out->remote_request_id, sizeof out->remote_request_id, "%s", v->valuestring);
        } else if (!strcmp(k, "num_tokens")) {
            if (cJSON_IsNull(v)) continue;
            if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < 1 ||
                v->valuedouble > 1e7) {
                pd_fail(err, "kv_transfer_params.num_tokens must be a positive integer");
                goto out;
            }
            out->num_tokens = (int)v->valuedouble;
        }
        /* Other keys (NIXL's remote_block_ids, remote_engine_id, ...) are not ours. */
    }
    out->present = true;
    /* remote_kv_addr alone is a prefill request (a proxy written for the
     * vLLM design sends only that); with remote_request_id it is a decode. */
    if (out->remote_request_id[0]) {
        if (!out->remote_kv_addr[0]) {
            pd_fail(err, "kv_transfer_params.remote_request_id needs remote_kv_addr");
            goto out;
        }
        out->do_remote_prefill = true;
        out->do_remote_decode = false;
    } else if (out->remote_kv_addr[0]) {
        if (out->do_remote_prefill) {
            /* Without the id there is no KV to fetch; read as a prefill
             * request it would ask for both directions at once. */
            pd_fail(err, "kv_transfer_params.do_remote_prefill needs remote_request_id (from "
                         "the prefill instance's response)");
            goto out;
        }
        out->do_remote_decode = true;
    }
    /* do_remote_* without an address is left for the caller to judge: a
     * colocated server ignores it, a connector instance refuses it. */
    rc = 0;
out:
    cJSON_Delete(root);
    if (rc != 0) memset(out, 0, sizeof *out);
    return rc;
}

void kv_save_result_json(const kv_save_result *r, char *buf, size_t cap) {
    snprintf(buf, cap,
             "{\"do_remote_prefill\":true,\"do_remote_decode\":false,\"remote_kv_addr\":\"%s\","
             "\"remote_request_id\":\"%s\",\"num_tokens\":%d}",
             r->kv_addr, r->transfer_id, r->num_tokens);
}
