/* test_p2p_msg: every KV control message survives encode → decode unchanged;
 * messages built independently with msgpack (as another implementation would)
 * decode as expected; malformed input (random bytes, every truncation, wrong
 * types, oversized fields) is an error, never a crash. */
#include "connector/p2p_msg.h"
#include "tests/common/testlib.h"

#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

static unsigned rng = 12345;
static unsigned next_rand(void) {
    rng = rng * 1103515245u + 12345u;
    return rng >> 8;
}

static void rand_str(char *buf, size_t cap) {
    size_t n = 1 + next_rand() % (cap - 1);
    for (size_t i = 0; i < n; i++)
        buf[i] = (char)(' ' + next_rand() % 95);
    buf[n] = 0;
}

static void rand_meta(p2p_meta *m) {
    rand_str(m->dtype, sizeof m->dtype);
    m->ndim = (int)(next_rand() % (P2P_NDIM_MAX + 1));
    for (int i = 0; i < m->ndim; i++)
        m->shape[i] = (int64_t)next_rand() * (int64_t)next_rand();
    m->nbytes = ((uint64_t)next_rand() << 32) ^ next_rand();
}

static bool meta_eq(const p2p_meta *a, const p2p_meta *b) {
    if (strcmp(a->dtype, b->dtype) || a->ndim != b->ndim || a->nbytes != b->nbytes) return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return false;
    return true;
}

static void check_cmd(const p2p_buf *b, p2p_cmd want) {
    p2p_cmd got;
    pd_err err;
    CHECKF(p2p_msg_cmd(b->data, b->len, &got, &err) == 0 && got == want, "cmd %s",
           p2p_cmd_name(want));
}

/* Every strict prefix of a valid message must fail to decode (and not crash). */
typedef int (*decode_fn)(const void *, size_t, void *, pd_err *);
static void check_truncations(const p2p_buf *b, decode_fn dec, void *scratch) {
    int ok = 0;
    for (size_t n = 0; n < b->len; n++) {
        pd_err err;
        char *copy = malloc(n ? n : 1); /* exact-size copy so ASan sees any over-read */
        memcpy(copy, b->data, n);
        if (dec(copy, n, scratch, &err) != 0) ok++;
        free(copy);
    }
    CHECKF(ok == (int)b->len, "%d of %zu truncations rejected", ok, b->len);
}

static void test_round_trips(void) {
    pd_err err;
    for (int iter = 0; iter < 200; iter++) {
        p2p_buf b;
        p2p_hello h = {{0}}, h2;
        rand_str(h.fingerprint, sizeof h.fingerprint);
        CHECK(p2p_hello_encode(&h, &b, &err) == 0);
        check_cmd(&b, P2P_CMD_HELLO);
        CHECK(p2p_hello_decode(b.data, b.len, &h2, &err) == 0 &&
              !strcmp(h.fingerprint, h2.fingerprint));
        if (iter == 0) check_truncations(&b, (decode_fn)p2p_hello_decode, &h2);
        free(b.data);

        p2p_new nw, nw2;
        for (int i = 0; i < P2P_UID_BYTES; i++)
            nw.unique_id[i] = (uint8_t)next_rand();
        CHECK(p2p_new_encode(&nw, &b, &err) == 0);
        check_cmd(&b, P2P_CMD_NEW);
        CHECK(p2p_new_decode(b.data, b.len, &nw2, &err) == 0 &&
              !memcmp(nw.unique_id, nw2.unique_id, P2P_UID_BYTES));
        if (iter == 0) check_truncations(&b, (decode_fn)p2p_new_decode, &nw2);
        free(b.data);

        p2p_put_msg p, p2;
        memset(&p, 0, sizeof p);
        rand_str(p.tensor_id, sizeof p.tensor_id);
        rand_meta(&p.meta);
        CHECK(p2p_put_encode(&p, &b, &err) == 0);
        check_cmd(&b, P2P_CMD_PUT);
        CHECK(p2p_put_decode(b.data, b.len, &p2, &err) == 0 && !strcmp(p.tensor_id, p2.tensor_id) &&
              meta_eq(&p.meta, &p2.meta));
        if (iter == 0) check_truncations(&b, (decode_fn)p2p_put_decode, &p2);
        /* A PUT is not a GET. */
        p2p_get_msg g2;
        CHECK(p2p_get_decode(b.data, b.len, &g2, &err) != 0);
        free(b.data);

        p2p_data_msg d, d2;
        memset(&d, 0, sizeof d);
        rand_str(d.tensor_id, sizeof d.tensor_id);
        d.nbytes = ((uint64_t)next_rand() << 20) ^ next_rand();
        CHECK(p2p_data_encode(&d, &b, &err) == 0);
        check_cmd(&b, P2P_CMD_DATA);
        CHECK(p2p_data_decode(b.data, b.len, &d2, &err) == 0 &&
              !strcmp(d.tensor_id, d2.tensor_id) && d.nbytes == d2.nbytes);
        free(b.data);

        p2p_get_msg g;
        memset(&g, 0, sizeof g);
        rand_str(g.tensor_id, sizeof g.tensor_id);
        g.max_nbytes = next_rand();
        CHECK(p2p_get_encode(&g, &b, &err) == 0);
        check_cmd(&b, P2P_CMD_GET);
        CHECK(p2p_get_decode(b.data, b.len, &g2, &err) == 0 && !strcmp(g.tensor_id, g2.tensor_id) &&
              g.max_nbytes == g2.max_nbytes);
        free(b.data);

        p2p_abort_msg a = {{0}}, a2;
        rand_str(a.tensor_id, sizeof a.tensor_id);
        CHECK(p2p_abort_encode(&a, &b, &err) == 0);
        check_cmd(&b, P2P_CMD_ABORT);
        CHECK(p2p_abort_decode(b.data, b.len, &a2, &err) == 0 &&
              !strcmp(a.tensor_id, a2.tensor_id));
        free(b.data);

        /* Replies: each optional part present or not. */
        p2p_reply r, r2;
        memset(&r, 0, sizeof r);
        r.ret = (int)(next_rand() % 3);
        r.reply_to = (p2p_cmd)(next_rand() % P2P_CMD_COUNT);
        if (next_rand() % 2) rand_str(r.tensor_id, sizeof r.tensor_id);
        if (next_rand() % 2) rand_str(r.error, sizeof r.error);
        if (next_rand() % 2) rand_str(r.fingerprint, sizeof r.fingerprint);
        r.new_comm = next_rand() % 2;
        r.drained = next_rand() % 2;
        r.sent = next_rand() % 2;
        if (next_rand() % 2) {
            r.has_meta = true;
            rand_meta(&r.meta);
            if (r.ret != P2P_RET_OK) { /* only nbytes travels */
                p2p_meta only = {.nbytes = r.meta.nbytes};
                r.meta = only;
            }
        }
        CHECK(p2p_reply_encode(&r, &b, &err) == 0);
        p2p_cmd c;
        CHECK(p2p_msg_cmd(b.data, b.len, &c, &err) != 0); /* replies have no cmd */
        CHECK(p2p_reply_decode(b.data, b.len, &r2, &err) == 0);
        CHECK(r2.ret == r.ret && r2.reply_to == r.reply_to && !strcmp(r2.tensor_id, r.tensor_id) &&
              !strcmp(r2.error, r.error) && !strcmp(r2.fingerprint, r.fingerprint) &&
              r2.new_comm == r.new_comm && r2.drained == r.drained && r2.sent == r.sent &&
              r2.has_meta == r.has_meta && (!r.has_meta || meta_eq(&r.meta, &r2.meta)));
        if (iter == 0) check_truncations(&b, (decode_fn)p2p_reply_decode, &r2);
        free(b.data);
    }
}

/* Messages packed here with msgpack directly, the way another implementation would. */
typedef struct hand {
    msgpack_sbuffer sb;
    msgpack_packer pk;
} hand;
static void h_begin(hand *h, size_t n) {
    msgpack_sbuffer_init(&h->sb);
    msgpack_packer_init(&h->pk, &h->sb, msgpack_sbuffer_write);
    msgpack_pack_map(&h->pk, n);
}
static void h_str(hand *h, const char *s) {
    msgpack_pack_str(&h->pk, strlen(s));
    msgpack_pack_str_body(&h->pk, s, strlen(s));
}

static void test_independent_and_malformed(void) {
    pd_err err;
    hand h;
    p2p_put_msg p;
    /* A PUT as Python's msgpack.dumps({"cmd": "PUT", "tensor_id": "x#3", "shape": [2, 7], "dtype":
     * "float16", "nbytes": 56}) */
    h_begin(&h, 5);
    h_str(&h, "cmd"), h_str(&h, "PUT");
    h_str(&h, "tensor_id"), h_str(&h, "x#3");
    h_str(&h, "shape"), msgpack_pack_array(&h.pk, 2), msgpack_pack_int(&h.pk, 2),
        msgpack_pack_int(&h.pk, 7);
    h_str(&h, "dtype"), h_str(&h, "float16");
    h_str(&h, "nbytes"), msgpack_pack_int(&h.pk, 56);
    CHECK(p2p_put_decode(h.sb.data, h.sb.size, &p, &err) == 0 && !strcmp(p.tensor_id, "x#3") &&
          p.meta.ndim == 2 && p.meta.shape[0] == 2 && p.meta.shape[1] == 7 &&
          !strcmp(p.meta.dtype, "float16") && p.meta.nbytes == 56);
    msgpack_sbuffer_destroy(&h.sb);

    /* Keys in another order and an unknown extra key are fine. */
    h_begin(&h, 4);
    h_str(&h, "extra"), msgpack_pack_nil(&h.pk);
    h_str(&h, "tensor_id"), h_str(&h, "abc");
    h_str(&h, "max_nbytes"), msgpack_pack_uint64(&h.pk, 99);
    h_str(&h, "cmd"), h_str(&h, "GET");
    p2p_get_msg g;
    CHECK(p2p_get_decode(h.sb.data, h.sb.size, &g, &err) == 0 && !strcmp(g.tensor_id, "abc") &&
          g.max_nbytes == 99);
    msgpack_sbuffer_destroy(&h.sb);

    /* protocol.md's GET without max_nbytes: room for anything. */
    h_begin(&h, 2);
    h_str(&h, "cmd"), h_str(&h, "GET");
    h_str(&h, "tensor_id"), h_str(&h, "abc");
    CHECK(p2p_get_decode(h.sb.data, h.sb.size, &g, &err) == 0 && g.max_nbytes == UINT64_MAX);
    msgpack_sbuffer_destroy(&h.sb);

    /* Wrong types and bad values, each named in the error. */
    struct {
        const char *what, *field;
    } cases[] = {{"id int", "tensor_id"}, {"shape str", "shape"},  {"neg dim", "shape[1]"},
                 {"9 dims", "9 dims"},    {"long id", "too long"}, {"neg nbytes", "nbytes"},
                 {"no dtype", "dtype"},   {"bad cmd", "PUT"}};
    for (int c = 0; c < (int)(sizeof cases / sizeof cases[0]); c++) {
        h_begin(&h, 5);
        h_str(&h, "cmd"), h_str(&h, c == 7 ? "PUTX" : "PUT");
        h_str(&h, "tensor_id");
        if (c == 0)
            msgpack_pack_int(&h.pk, 5);
        else if (c == 4) {
            char id[300];
            memset(id, 'a', sizeof id - 1);
            id[sizeof id - 1] = 0;
            h_str(&h, id);
        } else
            h_str(&h, "t");
        h_str(&h, "shape");
        if (c == 1)
            h_str(&h, "[2,3]");
        else if (c == 3) {
            msgpack_pack_array(&h.pk, 9);
            for (int i = 0; i < 9; i++)
                msgpack_pack_int(&h.pk, 1);
        } else {
            msgpack_pack_array(&h.pk, 2), msgpack_pack_int(&h.pk, 2),
                msgpack_pack_int(&h.pk, c == 2 ? -1 : 3);
        }
        h_str(&h, c == 6 ? "dtypo" : "dtype"), h_str(&h, "float32");
        h_str(&h, "nbytes"), msgpack_pack_int(&h.pk, c == 5 ? -24 : 24);
        int rc = p2p_put_decode(h.sb.data, h.sb.size, &p, &err);
        CHECKF(rc != 0 && strstr(err.msg, cases[c].field), "%s: rc %d, error \"%s\"", cases[c].what,
               rc, rc ? err.msg : "");
        msgpack_sbuffer_destroy(&h.sb);
    }

    /* NEW with a short unique_id; a reply without ret; an array instead of a map. */
    h_begin(&h, 2);
    h_str(&h, "cmd"), h_str(&h, "NEW");
    h_str(&h, "unique_id"), msgpack_pack_bin(&h.pk, 5), msgpack_pack_bin_body(&h.pk, "12345", 5);
    p2p_new nw;
    CHECK(p2p_new_decode(h.sb.data, h.sb.size, &nw, &err) != 0 && strstr(err.msg, "unique_id"));
    msgpack_sbuffer_destroy(&h.sb);
    h_begin(&h, 1);
    h_str(&h, "reply_to"), h_str(&h, "PUT");
    p2p_reply r;
    CHECK(p2p_reply_decode(h.sb.data, h.sb.size, &r, &err) != 0 && strstr(err.msg, "ret"));
    msgpack_sbuffer_destroy(&h.sb);
    msgpack_sbuffer_init(&h.sb);
    msgpack_packer_init(&h.pk, &h.sb, msgpack_sbuffer_write);
    msgpack_pack_array(&h.pk, 1), h_str(&h, "PUT");
    p2p_cmd cmd;
    CHECK(p2p_msg_cmd(h.sb.data, h.sb.size, &cmd, &err) != 0 &&
          strstr(err.msg, "not a msgpack map"));
    msgpack_sbuffer_destroy(&h.sb);

    /* Containers claiming billions of elements in a few bytes: refused before anything is
     * allocated. */
    const uint8_t huge_array[] = {0x81, 0xa3, 'c', 'm', 'd', 0xdd, 0xff, 0xff, 0xff, 0xff};
    const uint8_t huge_map[] = {0xdf, 0x7f, 0xff, 0xff, 0xff, 0xa3, 'c', 'm', 'd'};
    const uint8_t huge_str[] = {0x81, 0xa3, 'c', 'm', 'd', 0xdb, 0xff, 0xff, 0xff, 0xf0, 'P'};
    CHECK(p2p_msg_cmd(huge_array, sizeof huge_array, &cmd, &err) != 0 &&
          strstr(err.msg, "not valid msgpack"));
    CHECK(p2p_msg_cmd(huge_map, sizeof huge_map, &cmd, &err) != 0);
    CHECK(p2p_reply_decode(huge_str, sizeof huge_str, &r, &err) != 0);
    /* Bigger than any control message. */
    char *big = calloc(1, 70000);
    big[0] = (char)0x80;
    CHECK(p2p_msg_cmd(big, 70000, &cmd, &err) != 0 && strstr(err.msg, "too large"));
    free(big);

    /* Random bytes: every decoder says no or yes, never crashes (ASan build checks reads). */
    for (int iter = 0; iter < 3000; iter++) {
        size_t n = next_rand() % 96;
        uint8_t *buf = malloc(n ? n : 1);
        for (size_t i = 0; i < n; i++)
            buf[i] = (uint8_t)next_rand();
        if (n && iter % 2) buf[0] = 0x80 | (buf[0] & 0x0f); /* a fixmap header: go deeper */
        p2p_put_msg pm;
        p2p_reply rp;
        p2p_hello hl;
        p2p_msg_cmd(buf, n, &cmd, &err);
        p2p_put_decode(buf, n, &pm, &err);
        p2p_reply_decode(buf, n, &rp, &err);
        p2p_hello_decode(buf, n, &hl, &err);
        p2p_get_decode(buf, n, &g, &err);
        free(buf);
    }
    CHECK(p2p_msg_cmd(NULL, 0, &cmd, &err) != 0);
}

int main(void) {
    test_round_trips();
    test_independent_and_malformed();
    return test_finish();
}
