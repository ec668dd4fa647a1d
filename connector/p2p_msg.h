/* p2p_msg: the KV control messages of docs/kv-transfer.md as plain C structs,
 * each with one msgpack encoder and one decoder.
 *
 * Every message is one msgpack map with string keys. Requests carry "cmd";
 * replies carry "ret" (and "reply_to", the cmd they answer, plus the
 * "tensor_id" of the request, so that replies to many transfers in flight on
 * one socket can be matched without relying on order). Decoders never trust
 * their input: a truncated, mistyped or oversized field is an error naming the
 * field, never a crash. */
#ifndef P2P_MSG_H
#define P2P_MSG_H

#include "common/pd_common.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define P2P_ID_MAX 128 /* tensor ids are at most 127 bytes */
#define P2P_DTYPE_MAX 16
#define P2P_NDIM_MAX 8
#define P2P_FP_MAX 512 /* model fingerprint */
#define P2P_ERR_MAX 400
#define P2P_UID_BYTES 128 /* an ncclUniqueId */

typedef enum {
    P2P_CMD_HELLO, /* first contact: fingerprint check */
    P2P_CMD_NEW,   /* nccl: build the pair's communicator */
    P2P_CMD_PUT,   /* reserve room for a tensor */
    P2P_CMD_DATA,  /* the reserved tensor's bytes (tcp: next frame; nccl: ncclSend) */
    P2P_CMD_GET,   /* pull an offered tensor */
    P2P_CMD_ABORT, /* give up on a tensor: free it at once */
    P2P_CMD_COUNT
} p2p_cmd;

/* Reply codes. 0 and 1 are protocol.md's; 2 is pdserve's "refused for good". */
enum { P2P_RET_OK = 0, P2P_RET_RETRY = 1, P2P_RET_REFUSED = 2 };

const char *p2p_cmd_name(p2p_cmd cmd);

/* A tensor's description, shared by PUT and the GET reply. */
typedef struct p2p_meta {
    char dtype[P2P_DTYPE_MAX];
    int ndim;
    int64_t shape[P2P_NDIM_MAX];
    uint64_t nbytes;
} p2p_meta;

typedef struct p2p_hello {
    char fingerprint[P2P_FP_MAX];
} p2p_hello;
typedef struct p2p_new {
    uint8_t unique_id[P2P_UID_BYTES];
} p2p_new;
typedef struct p2p_put_msg {
    char tensor_id[P2P_ID_MAX];
    p2p_meta meta;
} p2p_put_msg;
typedef struct p2p_data_msg {
    char tensor_id[P2P_ID_MAX];
    uint64_t nbytes;
} p2p_data_msg;
typedef struct p2p_get_msg {
    char tensor_id[P2P_ID_MAX];
    uint64_t max_nbytes; /* room the requester reserved; larger tensors answer ret 1 + nbytes */
} p2p_get_msg;
typedef struct p2p_abort_msg {
    char tensor_id[P2P_ID_MAX];
} p2p_abort_msg;

typedef struct p2p_reply {
    int ret;
    p2p_cmd reply_to;
    char tensor_id[P2P_ID_MAX]; /* "" when the request had none */
    char error[P2P_ERR_MAX];    /* "" when ret == 0 */
    bool has_meta;              /* GET ret 0: the full meta; GET ret 1 "no room": only nbytes */
    p2p_meta meta;
    char fingerprint[P2P_FP_MAX]; /* HELLO replies: the answering side's fingerprint */
    /* PUT ret 1 over nccl, "new_comm": 1 on the wire: the receiver has no
     * communicator with the sender (it tore its side down), so the sender
     * must start a new one (NEW) before it asks again. */
    bool new_comm;
    /* nccl. DATA ret 2 with "drained": 1: the receiver dropped the tensor
     * but took its bytes off the communicator (and threw them away), so
     * the sender's ncclSend completes and the pair stays usable. ABORT ret
     * 0 with "sent": 1: the aborted tensor's bytes were already on their
     * way (its receiver keeps the reservation to drain them); without it,
     * none will come. */
    bool drained, sent;
} p2p_reply;

/* An encoded message: malloc'd bytes (free with free()). */
typedef struct p2p_buf {
    char *data;
    size_t len;
} p2p_buf;

int p2p_hello_encode(const p2p_hello *m, p2p_buf *out, pd_err *err);
int p2p_new_encode(const p2p_new *m, p2p_buf *out, pd_err *err);
int p2p_put_encode(const p2p_put_msg *m, p2p_buf *out, pd_err *err);
int p2p_data_encode(const p2p_data_msg *m, p2p_buf *out, pd_err *err);
int p2p_get_encode(const p2p_get_msg *m, p2p_buf *out, pd_err *err);
int p2p_abort_encode(const p2p_abort_msg *m, p2p_buf *out, pd_err *err);
int p2p_reply_encode(const p2p_reply *m, p2p_buf *out, pd_err *err);

/* Which request a buffer holds ("cmd"), or -1 with err (not a map, no cmd,
 * unknown cmd). Replies have no "cmd": use p2p_reply_decode on them. */
int p2p_msg_cmd(const void *data, size_t len, p2p_cmd *cmd, pd_err *err);
int p2p_hello_decode(const void *data, size_t len, p2p_hello *m, pd_err *err);
int p2p_new_decode(const void *data, size_t len, p2p_new *m, pd_err *err);
int p2p_put_decode(const void *data, size_t len, p2p_put_msg *m, pd_err *err);
int p2p_data_decode(const void *data, size_t len, p2p_data_msg *m, pd_err *err);
int p2p_get_decode(const void *data, size_t len, p2p_get_msg *m, pd_err *err);
int p2p_abort_decode(const void *data, size_t len, p2p_abort_msg *m, pd_err *err);
int p2p_reply_decode(const void *data, size_t len, p2p_reply *m, pd_err *err);

#endif
