/* p2p_msg: msgpack encoders and decoders for the KV control messages.
 * See p2p_msg.h for the rules and docs/kv-transfer.md for the field lists. */
#include "connector/p2p_msg.h"

#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

static const char *const cmd_names[P2P_CMD_COUNT] = {"HELLO", "NEW", "PUT", "DATA", "GET", "ABORT"};

const char *p2p_cmd_name(p2p_cmd cmd) {
    return cmd >= 0 && cmd < P2P_CMD_COUNT ? cmd_names[cmd] : "?";
}

static int cmd_from_name(const char *s, size_t n, p2p_cmd *out) {
    for (int i = 0; i < P2P_CMD_COUNT; i++) {
        if (strlen(cmd_names[i]) == n && !memcmp(cmd_names[i], s, n)) {
            *out = (p2p_cmd)i;
            return 0;
        }
    }
    return -1;
}

/* ---- encoding ---- */

typedef struct enc {
    msgpack_sbuffer sb;
    msgpack_packer pk;
} enc;

static void enc_begin(enc *e, size_t nfields) {
    msgpack_sbuffer_init(&e->sb);
    msgpack_packer_init(&e->pk, &e->sb, msgpack_sbuffer_write);
    msgpack_pack_map(&e->pk, nfields);
}

static void enc_key(enc *e, const char *key) {
    size_t n = strlen(key);
    msgpack_pack_str(&e->pk, n);
    msgpack_pack_str_body(&e->pk, key, n);
}

static void enc_str(enc *e, const char *key, const char *val) {
    enc_key(e, key);
    size_t n = strlen(val);
    msgpack_pack_str(&e->pk, n);
    msgpack_pack_str_body(&e->pk, val, n);
}

static void enc_u64(enc *e, const char *key, uint64_t v) {
    enc_key(e, key);
    msgpack_pack_uint64(&e->pk, v);
}

static void enc_shape(enc *e, const p2p_meta *m) {
    enc_key(e, "shape");
    msgpack_pack_array(&e->pk, (size_t)m->ndim);
    for (int i = 0; i < m->ndim; i++)
        msgpack_pack_int64(&e->pk, m->shape[i]);
}

/* Hands the sbuffer's bytes to out (they were malloc'd by msgpack_sbuffer_write). */
static int enc_end(enc *e, p2p_buf *out, pd_err *err) {
    if (!e->sb.data) {
        msgpack_sbuffer_destroy(&e->sb);
        return pd_fail(err, "out of memory encoding a KV control message");
    }
    out->len = e->sb.size;
    out->data = msgpack_sbuffer_release(&e->sb);
    return 0;
}

static int check_meta(const p2p_meta *m, pd_err *err) {
    if (m->ndim < 0 || m->ndim > P2P_NDIM_MAX)
        return pd_fail(err, "ndim %d is outside 0..%d", m->ndim, P2P_NDIM_MAX);
    return 0;
}

int p2p_hello_encode(const p2p_hello *m, p2p_buf *out, pd_err *err) {
    enc e;
    enc_begin(&e, 2);
    enc_str(&e, "cmd", "HELLO");
    enc_str(&e, "fingerprint", m->fingerprint);
    return enc_end(&e, out, err);
}

int p2p_new_encode(const p2p_new *m, p2p_buf *out, pd_err *err) {
    enc e;
    enc_begin(&e, 2);
    enc_str(&e, "cmd", "NEW");
    enc_key(&e, "unique_id");
    msgpack_pack_bin(&e.pk, P2P_UID_BYTES);
    msgpack_pack_bin_body(&e.pk, m->unique_id, P2P_UID_BYTES);
    return enc_end(&e, out, err);
}

int p2p_put_encode(const p2p_put_msg *m, p2p_buf *out, pd_err *err) {
    if (check_meta(&m->meta, err) != 0) return -1;
    enc e;
    enc_begin(&e, 5);
    enc_str(&e, "cmd", "PUT");
    enc_str(&e, "tensor_id", m->tensor_id);
    enc_shape(&e, &m->meta);
    enc_str(&e, "dtype", m->meta.dtype);
    enc_u64(&e, "nbytes", m->meta.nbytes);
    return enc_end(&e, out, err);
}

int p2p_data_encode(const p2p_data_msg *m, p2p_buf *out, pd_err *err) {
    enc e;
    enc_begin(&e, 3);
    enc_str(&e, "cmd", "DATA");
    enc_str(&e, "tensor_id", m->tensor_id);
    enc_u64(&e, "nbytes", m->nbytes);
    return enc_end(&e, out, err);
}

int p2p_get_encode(const p2p_get_msg *m, p2p_buf *out, pd_err *err) {
    enc e;
    enc_begin(&e, 3);
    enc_str(&e, "cmd", "GET");
    enc_str(&e, "tensor_id", m->tensor_id);
    enc_u64(&e, "max_nbytes", m->max_nbytes);
    return enc_end(&e, out, err);
}

int p2p_abort_encode(const p2p_abort_msg *m, p2p_buf *out, pd_err *err) {
    enc e;
    enc_begin(&e, 2);
    enc_str(&e, "cmd", "ABORT");
    enc_str(&e, "tensor_id", m->tensor_id);
    return enc_end(&e, out, err);
}

int p2p_reply_encode(const p2p_reply *m, p2p_buf *out, pd_err *err) {
    if (m->reply_to < 0 || m->reply_to >= P2P_CMD_COUNT)
        return pd_fail(err, "reply to unknown cmd %d", m->reply_to);
    bool full_meta = m->has_meta && m->ret == P2P_RET_OK;
    if (full_meta && check_meta(&m->meta, err) != 0) return -1;
    size_t n = 2 + (m->tensor_id[0] != 0) + (m->error[0] != 0) + (m->fingerprint[0] != 0) +
               m->new_comm + m->drained + m->sent + (m->has_meta ? (full_meta ? 3 : 1) : 0);
    enc e;
    enc_begin(&e, n);
    enc_key(&e, "ret");
    msgpack_pack_int(&e.pk, m->ret);
    enc_str(&e, "reply_to", p2p_cmd_name(m->reply_to));
    if (m->tensor_id[0]) enc_str(&e, "tensor_id", m->tensor_id);
    if (m->error[0]) enc_str(&e, "error", m->error);
    if (m->fingerprint[0]) enc_str(&e, "fingerprint", m->fingerprint);
    if (m->new_comm) enc_u64(&e, "new_comm", 1);
    if (m->drained) enc_u64(&e, "drained", 1);
    if (m->sent) enc_u64(&e, "sent", 1);
    if (m->has_meta) {
        if (full_meta) {
            enc_shape(&e, &m->meta);
            enc_str(&e, "dtype", m->meta.dtype);
        }
        enc_u64(&e, "nbytes", m->meta.nbytes);
    }
    return enc_end(&e, out, err);
}

/* ---- decoding ---- */

/* msgpack-c's unpacker allocates for a container's claimed size before it has seen the
 * elements, so 5 bytes claiming 4 billion elements would cost gigabytes. This walk checks,
 * without allocating, that the buffer is one well-formed object whose every container and
 * string fits in the bytes actually there. */
#define P2P_MSG_MAX (64 * 1024) /* control messages are small; anything bigger is not one */

static uint64_t be_uint(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

static int msgpack_plausible(const uint8_t *p, size_t len) {
    size_t pos = 0;
    uint64_t pending = 1; /* objects still to read */
    while (pending > 0) {
        if (pos >= len) return -1;
        uint8_t b = p[pos++];
        uint64_t items = 0, skip = 0; /* elements of a container / payload bytes of a scalar */
        int hdr = 0;                  /* size of the length field after the type byte */
        if (b <= 0x7f || b >= 0xe0 || (b >= 0xc0 && b <= 0xc3 && b != 0xc1)) {
            /* fixints, nil, booleans */
        } else if (b >= 0x80 && b <= 0x8f) {
            items = 2u * (b & 0x0f);
        } else if (b >= 0x90 && b <= 0x9f) {
            items = b & 0x0f;
        } else if (b >= 0xa0 && b <= 0xbf) {
            skip = b & 0x1f;
        } else {
            switch (b) {
            case 0xc4:
            case 0xd9:
                hdr = 1;
                break; /* bin8, str8 */
            case 0xc5:
            case 0xda:
                hdr = 2;
                break;
            case 0xc6:
            case 0xdb:
                hdr = 4;
                break;
            case 0xc7:
                hdr = 1, skip = 1;
                break; /* ext8: length, then a type byte */
            case 0xc8:
                hdr = 2, skip = 1;
                break;
            case 0xc9:
                hdr = 4, skip = 1;
                break;
            case 0xca:
                skip = 4;
                break;
            case 0xcb:
                skip = 8;
                break;
            case 0xcc:
            case 0xd0:
                skip = 1;
                break;
            case 0xcd:
            case 0xd1:
                skip = 2;
                break;
            case 0xce:
            case 0xd2:
                skip = 4;
                break;
            case 0xcf:
            case 0xd3:
                skip = 8;
                break;
            case 0xd4:
                skip = 2;
                break; /* fixext: type byte + 1..16 */
            case 0xd5:
                skip = 3;
                break;
            case 0xd6:
                skip = 5;
                break;
            case 0xd7:
                skip = 9;
                break;
            case 0xd8:
                skip = 17;
                break;
            case 0xdc:
            case 0xde:
                hdr = 2;
                break; /* array16, map16 */
            case 0xdd:
            case 0xdf:
                hdr = 4;
                break;
            default:
                return -1; /* 0xc1: never used */
            }
            if (hdr) {
                if (len - pos < (size_t)hdr) return -1;
                uint64_t n = be_uint(p + pos, hdr);
                pos += (size_t)hdr;
                if (b == 0xdc || b == 0xdd)
                    items = n;
                else if (b == 0xde || b == 0xdf)
                    items = 2 * n;
                else
                    skip += n;
            }
        }
        if (skip > len - pos) return -1;
        pos += (size_t)skip;
        if (items > len - pos) return -1; /* every element takes at least one byte */
        pending += items - 1;
    }
    return 0;
}

typedef struct dec {
    msgpack_unpacked up;
    const msgpack_object_map *map;
} dec;

static int dec_begin(dec *d, const void *data, size_t len, pd_err *err) {
    msgpack_unpacked_init(&d->up);
    size_t off = 0;
    if (!data || len == 0) return pd_fail(err, "empty KV control message");
    if (len > P2P_MSG_MAX)
        return pd_fail(err, "KV control message of %zu bytes is too large (max %d)", len,
                       P2P_MSG_MAX);
    if (msgpack_plausible(data, len) != 0)
        return pd_fail(err, "KV control message is not valid msgpack (%zu bytes)", len);
    if (msgpack_unpack_next(&d->up, data, len, &off) != MSGPACK_UNPACK_SUCCESS)
        return pd_fail(err, "KV control message is not valid msgpack (%zu bytes)", len);
    if (off != len) return pd_fail(err, "KV control message has %zu trailing bytes", len - off);
    if (d->up.data.type != MSGPACK_OBJECT_MAP)
        return pd_fail(err, "KV control message is not a msgpack map");
    d->map = &d->up.data.via.map;
    return 0;
}

static void dec_end(dec *d) {
    msgpack_unpacked_destroy(&d->up);
}

static const msgpack_object *dec_find(const dec *d, const char *key) {
    size_t n = strlen(key);
    for (uint32_t i = 0; i < d->map->size; i++) {
        const msgpack_object *k = &d->map->ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == n &&
            !memcmp(k->via.str.ptr, key, n))
            return &d->map->ptr[i].val;
    }
    return NULL;
}

/* A string field (msgpack str, or bin from peers that pack bytes) into buf. */
static int dec_str(const dec *d, const char *key, char *buf, size_t cap, bool required,
                   pd_err *err) {
    buf[0] = 0;
    const msgpack_object *o = dec_find(d, key);
    if (!o) return required ? pd_fail(err, "KV control message lacks field \"%s\"", key) : 0;
    const char *p;
    size_t n;
    if (o->type == MSGPACK_OBJECT_STR) {
        p = o->via.str.ptr;
        n = o->via.str.size;
    } else if (o->type == MSGPACK_OBJECT_BIN) {
        p = o->via.bin.ptr;
        n = o->via.bin.size;
    } else {
        return pd_fail(err, "KV control message field \"%s\" is not a string", key);
    }
    if (n >= cap)
        return pd_fail(err, "KV control message field \"%s\" is too long (%zu bytes, max %zu)", key,
                       n, cap - 1);
    if (memchr(p, 0, n))
        return pd_fail(err, "KV control message field \"%s\" contains a NUL byte", key);
    memcpy(buf, p, n);
    buf[n] = 0;
    return 0;
}

static int obj_i64(const msgpack_object *o, int64_t *v) {
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 <= (uint64_t)INT64_MAX) {
        *v = (int64_t)o->via.u64;
        return 0;
    }
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *v = o->via.i64;
        return 0;
    }
    return -1;
}

static int dec_u64(const dec *d, const char *key, uint64_t *v, bool required, pd_err *err) {
    const msgpack_object *o = dec_find(d, key);
    if (!o) return required ? pd_fail(err, "KV control message lacks field \"%s\"", key) : 0;
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return pd_fail(err, "KV control message field \"%s\" is not a non-negative integer", key);
    *v = o->via.u64;
    return 0;
}

static int dec_meta(const dec *d, p2p_meta *m, pd_err *err) {
    memset(m, 0, sizeof *m);
    const msgpack_object *o = dec_find(d, "shape");
    if (!o) return pd_fail(err, "KV control message lacks field \"shape\"");
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return pd_fail(err, "KV control message field \"shape\" is not an array");
    if (o->via.array.size > P2P_NDIM_MAX)
        return pd_fail(err, "KV control message shape has %u dims (max %d)", o->via.array.size,
                       P2P_NDIM_MAX);
    m->ndim = (int)o->via.array.size;
    for (int i = 0; i < m->ndim; i++) {
        if (obj_i64(&o->via.array.ptr[i], &m->shape[i]) != 0 || m->shape[i] < 0)
            return pd_fail(err, "KV control message shape[%d] is not a non-negative integer", i);
    }
    if (dec_str(d, "dtype", m->dtype, sizeof m->dtype, true, err) != 0) return -1;
    return dec_u64(d, "nbytes", &m->nbytes, true, err);
}

/* Opens a request and checks that its cmd is the expected one. */
static int dec_request(dec *d, const void *data, size_t len, p2p_cmd want, pd_err *err) {
    if (dec_begin(d, data, len, err) != 0) return -1;
    char cmd[16];
    if (dec_str(d, "cmd", cmd, sizeof cmd, true, err) != 0) return -1;
    if (strcmp(cmd, p2p_cmd_name(want)) != 0)
        return pd_fail(err, "KV control message is %s, expected %s", cmd, p2p_cmd_name(want));
    return 0;
}

int p2p_msg_cmd(const void *data, size_t len, p2p_cmd *cmd, pd_err *err) {
    dec d;
    int rc = dec_begin(&d, data, len, err);
    char name[16];
    if (rc == 0) rc = dec_str(&d, "cmd", name, sizeof name, true, err);
    if (rc == 0 && cmd_from_name(name, strlen(name), cmd) != 0)
        rc = pd_fail(err, "KV control message has unknown cmd \"%s\"", name);
    dec_end(&d);
    return rc;
}

int p2p_hello_decode(const void *data, size_t len, p2p_hello *m, pd_err *err) {
    memset(m, 0, sizeof *m);
    dec d;
    int rc = dec_request(&d, data, len, P2P_CMD_HELLO, err);
    if (rc == 0) rc = dec_str(&d, "fingerprint", m->fingerprint, sizeof m->fingerprint, true, err);
    dec_end(&d);
    return rc;
}

int p2p_new_decode(const void *data, size_t len, p2p_new *m, pd_err *err) {
    memset(m, 0, sizeof *m);
    dec d;
    int rc = dec_request(&d, data, len, P2P_CMD_NEW, err);
    if (rc == 0) {
        const msgpack_object *o = dec_find(&d, "unique_id");
        if (!o || o->type != MSGPACK_OBJECT_BIN || o->via.bin.size != P2P_UID_BYTES)
            rc = pd_fail(err, "KV control message NEW needs \"unique_id\" as %d bytes of bin",
                         P2P_UID_BYTES);
        else
            memcpy(m->unique_id, o->via.bin.ptr, P2P_UID_BYTES);
    }
    dec_end(&d);
    return rc;
}

int p2p_put_decode(const void *data, size_t len, p2p_put_msg *m, pd_err *err) {
    memset(m, 0, sizeof *m);
    dec d;
    int rc = dec_request(&d, data, len, P2P_CMD_PUT, err);
    if (rc == 0) rc = dec_str(&d, "tensor_id", m->tensor_id, sizeof m->tensor_id, true, err);
    if (rc == 0) rc = dec_meta(&d, &m->meta, err);
    dec_end(&d);
    return rc;
}

int p2p_data_decode(const void *data, size_t len, p2p_data_msg *m, pd_err *err) {
    memset(m, 0, sizeof *m);
    dec d;
    int rc = dec_request(&d, data, len, P2P_CMD_DATA, err);
    if (rc == 0) rc = dec_str(&d, "tensor_id", m->tensor_id, sizeof m->tensor_id, true, err);
    if (rc == 0) rc = dec_u64(&d, "nbytes", &m->nbytes, true, err);
    dec_end(&d);
    return rc;
}

int p2p_get_decode(const void *data, size_t len, p2p_get_msg *m, pd_err *err) {
    memset(m, 0, sizeof *m);
    m->max_nbytes = UINT64_MAX; /* a peer that does not say has room for anything */
    dec d;
    int rc = dec_request(&d, data, len, P2P_CMD_GET, err);
    if (rc == 0) rc = dec_str(&d, "tensor_id", m->tensor_id, sizeof m->tensor_id, true, err);
    if (rc == 0) rc = dec_u64(&d, "max_nbytes", &m->max_nbytes, false, err);
    dec_end(&d);
    return rc;
}

int p2p_abort_decode(const void *data, size_t len, p2p_abort_msg *m, pd_err *err) {
    memset(m, 0, sizeof *m);
    dec d;
    int rc = dec_request(&d, data, len, P2P_CMD_ABORT, err);
    if (rc == 0) rc = dec_str(&d, "tensor_id", m->tensor_id, sizeof m->tensor_id, true, err);
    dec_end(&d);
    return rc;
}

int p2p_reply_decode(const void *data, size_t len, p2p_reply *m, pd_err *err) {
    memset(m, 0, sizeof *m);
    dec d;
    int rc = dec_begin(&d, data, len, err);
    if (rc == 0) {
        const msgpack_object *o = dec_find(&d, "ret");
        int64_t ret;
        if (!o || obj_i64(o, &ret) != 0 || ret < 0 || ret > 255)
            rc = pd_fail(err, "KV control reply lacks an integer \"ret\"");
        else
            m->ret = (int)ret;
    }
    char to[16];
    if (rc == 0) rc = dec_str(&d, "reply_to", to, sizeof to, true, err);
    if (rc == 0 && cmd_from_name(to, strlen(to), &m->reply_to) != 0)
        rc = pd_fail(err, "KV control reply answers unknown cmd \"%s\"", to);
    if (rc == 0) rc = dec_str(&d, "tensor_id", m->tensor_id, sizeof m->tensor_id, false, err);
    if (rc == 0) rc = dec_str(&d, "error", m->error, sizeof m->error, false, err);
    if (rc == 0) rc = dec_str(&d, "fingerprint", m->fingerprint, sizeof m->fingerprint, false, err);
    uint64_t new_comm = 0, drained = 0, sent = 0;
    if (rc == 0) rc = dec_u64(&d, "new_comm", &new_comm, false, err);
    if (rc == 0) rc = dec_u64(&d, "drained", &drained, false, err);
    if (rc == 0) rc = dec_u64(&d, "sent", &sent, false, err);
    m->new_comm = new_comm != 0;
    m->drained = drained != 0;
    m->sent = sent != 0;
    if (rc == 0 && dec_find(&d, "nbytes")) {
        m->has_meta = true;
        if (dec_find(&d, "shape"))
            rc = dec_meta(&d, &m->meta, err);
        else
            rc = dec_u64(&d, "nbytes", &m->meta.nbytes, true, err);
    }
    dec_end(&d);
    return rc;
}
