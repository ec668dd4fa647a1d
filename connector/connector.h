/* connector: the engine's side of disaggregated prefill/decode — the one
 * header the engine includes. It follows the two-sided shape of vLLM's KV
 * connector, reduced to what pdserve needs:
 *
 *   producer (prefill, kv_producer): when a request's prompt is fully
 *     computed, kv_connector_save() gathers its K/V from the paged cache and
 *     hands it to the transfer engine (PUT, PUT_ASYNC or GET offer) under a
 *     transfer id this instance chose; the id and our KV address go back to
 *     the client in the response's kv_transfer_params.
 *   consumer (decode, kv_consumer): a request that arrives with
 *     kv_transfer_params naming a remote prefill starts a load
 *     (kv_connector_load_begin); the engine polls it each step without
 *     blocking (kv_connector_load_poll), which writes each layer into the
 *     request's blocks as it arrives when the request already has them; when
 *     everything arrived the rest of the K/V of the first num_tokens - 1
 *     prompt tokens is written (kv_connector_load_apply) and only the last
 *     prompt token runs.
 *
 * The engine knows nothing of ZMQ or NCCL; those live behind connector/p2p.h.
 * Nothing here parses request ids: requests are matched by the
 * (remote_kv_addr, remote_request_id) pair of kv_transfer_params. */
#ifndef PD_CONNECTOR_H
#define PD_CONNECTOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/pd_common.h"
#include "model/opt.h"

typedef enum { KV_ROLE_PRODUCER = 0, KV_ROLE_CONSUMER = 1, KV_ROLE_BOTH = 2 } kv_role;
typedef enum { KV_SEND_PUT = 0, KV_SEND_PUT_ASYNC = 1, KV_SEND_GET = 2 } kv_send_type;
typedef enum { KV_TRANSPORT_TCP = 0, KV_TRANSPORT_NCCL = 1 } kv_transport;

/* --kv-transfer-config, with vLLM's keys (see docs/disaggregation.md). */
typedef struct kv_transfer_config {
    kv_role role;
    char kv_ip[64];
    int kv_port;              /* 14579 */
    double kv_buffer_size;    /* 1e9 bytes */
    char proxy_ip[64];        /* "" = do not announce */
    int proxy_port;
    int http_port;            /* 0 = the server's --port */
    kv_send_type send_type;   /* PUT_ASYNC */
    kv_transport transport;   /* tcp on CPU */
    int nccl_num_channels;    /* 8 */
    double timeout_s;         /* 30: every wait of a transfer (pdserve extension key) */
    double announce_interval_s; /* 3 (pdserve extension key) */
    /* false (pdserve extension key): a consumer on tcp copies each received
     * layer into page-locked memory on the transfer engine's thread, so its
     * engine thread queues a DMA instead of a pageable copy (docs/disaggregation.md) */
    bool recv_into_pinned;
    /* vLLM's key: the page-locked memory the connector's host pool may hold
     * (vLLM: 32, allocated at start; pdserve: 1, allocated as needed) */
    double mem_pool_size_gb;
    /* 1 (pdserve extension key): TCP connections per peer on the tcp
     * transport, layers spread over them (docs/kv-transfer.md) */
    int tcp_streams;
    /* vLLM's key kv_load_failure_policy: "fail" (default, as vLLM) ends a
     * request whose KV did not come with an error; "recompute" computes its
     * prompt here instead, as a colocated instance would */
    bool recompute_on_load_failure;
} kv_transfer_config;

/* Parse and validate the JSON text of --kv-transfer-config. Wrong types or
 * values are an error naming the key; unknown keys are logged once. */
int kv_transfer_config_parse(const char *json, kv_transfer_config *out, pd_err *err);
const char *kv_role_name(kv_role r);          /* "kv_producer", ... */
const char *kv_send_type_name(kv_send_type t); /* "PUT", "PUT_ASYNC", "GET" */

/* A request's kv_transfer_params, as far as this instance acts on them. */
typedef struct kv_request_params {
    bool present;
    bool do_remote_decode;     /* producer: push the prompt's KV to remote_kv_addr */
    bool do_remote_prefill;    /* consumer: the prompt's KV comes from remote_kv_addr */
    char remote_kv_addr[128];  /* "ip:port" */
    char remote_request_id[128];
    int num_tokens;            /* optional (0 = not given) */
} kv_request_params;

/* Parse the kv_transfer_params JSON object text (NULL or "null": not present).
 * Malformed params (wrong types, missing fields, bad host:port) are an error
 * naming the field, for an HTTP 400. */
int kv_request_params_parse(const char *json, kv_request_params *out, pd_err *err);

/* What a producer reports back: the body of the response's kv_transfer_params. */
typedef struct kv_save_result {
    char kv_addr[128];     /* our KV address */
    char transfer_id[128]; /* the id we chose */
    int num_tokens;
} kv_save_result;
/* Render {"do_remote_prefill":true,"remote_kv_addr":...,"remote_request_id":...,"num_tokens":N}
 * into buf (always NUL-terminated). */
void kv_save_result_json(const kv_save_result *r, char *buf, size_t cap);

typedef struct kv_connector kv_connector;

/* Create the connector for a loaded model and its KV storage: starts the
 * transfer engine (binds kv_ip:kv_port) and, with proxy_ip set, the
 * discovery announcer. http_port: the server's --port (advertised when the
 * config has no http_port). on_kv_arrival (may be NULL) is called with ctx
 * from the transfer engine's thread whenever received KV became ready to
 * take or failed: a consumer's engine wakes up for kv_connector_load_poll
 * then instead of on a timer. It must not block or call the connector. */
int kv_connector_create(const kv_transfer_config *cfg, opt_model *model, opt_kv_storage *kv,
                        pd_backend *be, int http_port, void (*on_kv_arrival)(void *ctx), void *ctx,
                        kv_connector **out, pd_err *err);
void kv_connector_destroy(kv_connector *c);
const kv_transfer_config *kv_connector_config(const kv_connector *c);
const char *kv_connector_address(const kv_connector *c);
bool kv_connector_is_producer(const kv_connector *c); /* kv_producer or kv_both */
bool kv_connector_is_consumer(const kv_connector *c); /* kv_consumer or kv_both */

/* Producer: the request's n_tokens prompt tokens are in the cache at
 * block_table. Gathers their K/V and sends it to params->remote_kv_addr
 * (PUT: before returning; PUT_ASYNC: on the send thread; GET: kept until the
 * consumer pulls it). request_tag is only for logs. */
int kv_connector_save(kv_connector *c, const kv_request_params *params, const int32_t *block_table, int n_tokens,
                      const char *request_tag, kv_save_result *out, pd_err *err);

/* Consumer: one request's load. */
typedef struct kv_load kv_load;
/* n_prompt: the request's prompt length here; KV is expected for n_prompt
 * tokens. Starts pulling in GET mode. The deadline is now + timeout_s. */
int kv_connector_load_begin(kv_connector *c, const kv_request_params *params, int n_prompt, const char *request_tag,
                            kv_load **out, pd_err *err);
/* Non-blocking: 1 = everything arrived, 0 = not yet, -1 = failed (deadline,
 * producer error, shape mismatch): err says why; *http_status gets 504 for a
 * deadline, 500 otherwise. block_table: the request's blocks when it already
 * has them (covering n_prompt tokens), else NULL. With blocks, each layer that
 * arrived is written into the cache (its first n_prompt - 1 tokens) and freed
 * at once, while later layers are still on their way; without, layers wait
 * for load_apply. */
int kv_connector_load_poll(kv_connector *c, kv_load *l, const int32_t *block_table,
                           int *http_status, pd_err *err);
/* Whether load_poll has written any received layer into the cache. Until it
 * has, the blocks the request holds carry nothing of this load and may be
 * given back (poll on with a NULL table; load_apply then writes it all). */
bool kv_connector_load_wrote_any(const kv_load *l);
/* Write the first n_tokens tokens of the received K/V into the cache at
 * block_table (which must cover them; the same table load_poll was given,
 * if any), as far as load_poll has not already. */
int kv_connector_load_apply(kv_connector *c, kv_load *l, const int32_t *block_table, int n_tokens, pd_err *err);
/* Free the load. When it was not applied (abort, deadline), the producer is
 * told to drop its copy at once. */
void kv_connector_load_end(kv_connector *c, kv_load *l);

/* Transfer counters for /metrics. */
typedef struct kv_connector_stats {
    uint64_t saves_ok, saves_failed, loads_ok, loads_failed; /* per request */
    double save_seconds, load_seconds; /* summed wall time of finished saves/loads */
    /* layers written into the cache, and of those the ones written as they
     * arrived (the request had its blocks while it waited) */
    uint64_t layers_written, layers_written_on_arrival;
    /* of those, layers moved to the device by a queued copy from page-locked
     * memory (recv_into_pinned); the rest, from host memory, by a blocking copy */
    uint64_t layers_written_from_pinned;
    /* from the transfer engine, per tensor: */
    uint64_t sends_ok, sends_failed, recvs_ok, recvs_failed, retries, aborts;
    uint64_t bytes_sent, bytes_received;
    size_t buffered_bytes;
    /* host memory of the tcp buffer pool, idle or in use: page-locked (at
     * most mem_pool_size_gb) and ordinary */
    size_t host_pool_pinned_bytes, host_pool_pageable_bytes;
    int connections; /* open connections to peers (up to tcp_streams each) */
    uint64_t comm_resets; /* nccl: pair communicators torn down */
} kv_connector_stats;
void kv_connector_stats_get(kv_connector *c, kv_connector_stats *out);

#endif
