/* test_discovery: the discovery protocol and the registry.
 *  - announce_encode (instance side) and discovery_decode (proxy side) round
 *    trip; bad payloads built independently with msgpack's packer (wrong
 *    types, unknown type, missing keys, bad addresses, every truncation of a
 *    good message, trailing bytes) are rejected;
 *  - the registry with a driven clock: expiry, refresh, static instances,
 *    round robin order, backoff after a failure, exclusion, least loaded;
 *  - live: a real announcer and a real ROUTER over TCP register a kv_both
 *    instance, bad messages on the wire do not stop discovery, and an
 *    instance that stops announcing is removed after the timeout. */
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "connector/announce.h"
#include "proxy/discovery.h"
#include "proxy/registry.h"
#include "tests/common/testlib.h"

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void pack_str(msgpack_packer *pk, const char *s) {
    msgpack_pack_str(pk, strlen(s));
    msgpack_pack_str_body(pk, s, strlen(s));
}

/* A map of string pairs; a NULL value packs the integer 7 instead. */
static void pack_map(msgpack_sbuffer *sb, const char *const *kv, int pairs) {
    msgpack_sbuffer_init(sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, (size_t)pairs);
    for (int i = 0; i < pairs; i++) {
        pack_str(&pk, kv[2 * i]);
        if (kv[2 * i + 1])
            pack_str(&pk, kv[2 * i + 1]);
        else
            msgpack_pack_int(&pk, 7);
    }
}

static int decode_map(const char *const *kv, int pairs, disc_msg *m, pd_err *err) {
    msgpack_sbuffer sb;
    pack_map(&sb, kv, pairs);
    int rc = discovery_decode(sb.data, sb.size, m, err);
    msgpack_sbuffer_destroy(&sb);
    return rc;
}

static void test_round_trip(void) {
    const char *cases[][3] = {{"P", "10.0.0.1:8100", "10.0.0.1:14579"},
                              {"D", "127.0.0.1:1", "127.0.0.1:65535"},
                              {"P", "[::1]:8000", "[fe80::1]:14580"},
                              {"D", "host-name.example:80", "kv.example:9"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *buf = NULL;
        size_t len = 0;
        pd_err err;
        CHECK(announce_encode(cases[i][0], cases[i][1], cases[i][2], &buf, &len, &err) == 0);
        disc_msg m;
        int rc = discovery_decode(buf, len, &m, &err);
        CHECKF(rc == 0, "case %zu: %s", i, err.msg);
        if (rc == 0) {
            CHECK(m.role == (cases[i][0][0] == 'P' ? ROLE_PREFILL : ROLE_DECODE));
            CHECK(!strcmp(m.http, cases[i][1]));
            CHECK(!strcmp(m.kv, cases[i][2]));
        }
        /* Every strict prefix is incomplete, and extra bytes are refused. */
        for (size_t cut = 0; cut < len; cut++)
            CHECKF(discovery_decode(buf, cut, &m, &err) != 0, "prefix %zu of %zu", cut, len);
        char *more = malloc(len + 1);
        memcpy(more, buf, len);
        more[len] = (char)0xc0; /* msgpack nil */
        CHECK(discovery_decode(more, len + 1, &m, &err) != 0);
        free(more);
        /* The encoding is the plain map of protocol.md: 3 string pairs. */
        msgpack_unpacked u;
        msgpack_unpacked_init(&u);
        CHECK(msgpack_unpack_next(&u, buf, len, NULL) == MSGPACK_UNPACK_SUCCESS);
        CHECK(u.data.type == MSGPACK_OBJECT_MAP && u.data.via.map.size == 3);
        msgpack_unpacked_destroy(&u);
        free(buf);
    }
}

static void test_bad_messages(void) {
    disc_msg m;
    pd_err err;
    const char *ok[] = {"type", "P", "http_address", "1.2.3.4:5", "zmq_address", "1.2.3.4:6"};
    CHECK(decode_map(ok, 3, &m, &err) == 0);
    /* Extra keys are tolerated (room for later fields), key order is free. */
    const char *extra[] = {"zmq_address",  "1.2.3.4:6", "version", "2",
                           "http_address", "1.2.3.4:5", "type",    "D"};
    CHECK(decode_map(extra, 4, &m, &err) == 0 && m.role == ROLE_DECODE);
    const char *unknown[] = {"type", "X", "http_address", "1.2.3.4:5", "zmq_address", "1.2.3.4:6"};
    CHECK(decode_map(unknown, 3, &m, &err) != 0 && strstr(err.msg, "unknown type"));
    const char *lower[] = {"type", "p", "http_address", "1.2.3.4:5", "zmq_address", "1.2.3.4:6"};
    CHECK(decode_map(lower, 3, &m, &err) != 0);
    const char *missing[] = {"type", "P", "http_address", "1.2.3.4:5"};
    CHECK(decode_map(missing, 2, &m, &err) != 0 && strstr(err.msg, "zmq_address"));
    const char *intval[] = {"type", "P", "http_address", NULL, "zmq_address", "1.2.3.4:6"};
    CHECK(decode_map(intval, 3, &m, &err) != 0 && strstr(err.msg, "http_address"));
    const char *bad_addrs[] = {"1.2.3.4", "1.2.3.4:0", "1.2.3.4:70000",
                               ":80",     "a b:1",     "1.2.3.4:80x",
                               "::1:80",  "",          "h/x:1"};
    for (size_t i = 0; i < sizeof bad_addrs / sizeof bad_addrs[0]; i++) {
        const char *kv[] = {"type", "D", "http_address", bad_addrs[i], "zmq_address", "1.2.3.4:6"};
        CHECKF(decode_map(kv, 3, &m, &err) != 0, "address '%s' accepted", bad_addrs[i]);
    }
    /* Not a map at all. */
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 1);
    pack_str(&pk, "P");
    CHECK(discovery_decode(sb.data, sb.size, &m, &err) != 0);
    msgpack_sbuffer_destroy(&sb);
    CHECK(discovery_decode("\xff\xff\xff", 3, &m, &err) != 0);
    CHECK(discovery_decode("", 0, &m, &err) != 0);
}

static void test_registry(void) {
    reg_config c = {.instance_timeout = 5, .failure_backoff = 2, .least_loaded = false};
    registry *r = registry_create(&c);
    double t = 1000;
    CHECK(registry_announce(r, ROLE_PREFILL, "a:1", "a:2", t) == 1);
    CHECK(registry_announce(r, ROLE_PREFILL, "b:1", "b:2", t) == 1);
    CHECK(registry_announce(r, ROLE_PREFILL, "c:1", "c:2", t) == 1);
    CHECK(registry_announce(r, ROLE_PREFILL, "a:1", "a:2", t + 1) == 0); /* refresh */
    CHECK(registry_live(r, ROLE_PREFILL, t) == 3 && registry_live(r, ROLE_DECODE, t) == 0);
    pd_err err;
    CHECK(registry_add_static(r, ROLE_DECODE, "http://s:9/", NULL, &err) == 0);
    reg_pick p;
    CHECK(registry_pick(r, ROLE_DECODE, NULL, 0, t, &p) == 0 && !strcmp(p.http, "s:9") &&
          !strcmp(p.kv, "s:14579"));
    registry_release(r, p.id, 0.1, false, t);

    /* Round robin: six picks visit a, b, c twice, in a fixed cycle. */
    char seq[6][REG_ADDR_MAX];
    for (int i = 0; i < 6; i++) {
        CHECK(registry_pick(r, ROLE_PREFILL, NULL, 0, t, &p) == 0);
        snprintf(seq[i], sizeof seq[i], "%s", p.http);
        registry_release(r, p.id, 0.01, false, t);
    }
    for (int i = 0; i < 3; i++)
        CHECK(!strcmp(seq[i], seq[i + 3]) && strcmp(seq[i], seq[(i + 1) % 3]));

    /* A failure puts b in backoff: it is skipped until the backoff ends. */
    int b_id = -1;
    for (int i = 0; i < 3 && b_id < 0; i++) {
        registry_pick(r, ROLE_PREFILL, NULL, 0, t, &p);
        if (!strcmp(p.http, "b:1")) b_id = p.id;
        registry_release(r, p.id, 0.01, !strcmp(p.http, "b:1"), t);
    }
    CHECK(b_id >= 0);
    for (int i = 0; i < 6; i++) {
        CHECK(registry_pick(r, ROLE_PREFILL, NULL, 0, t + 1, &p) == 0 && strcmp(p.http, "b:1"));
        registry_release(r, p.id, 0.01, false, t + 1);
    }
    /* Exclusion (the retry path) and "everything else is excluded": b again. */
    int ex[2];
    registry_pick(r, ROLE_PREFILL, NULL, 0, t + 1, &p);
    ex[0] = p.id;
    registry_release(r, p.id, 0.01, false, t + 1);
    registry_pick(r, ROLE_PREFILL, ex, 1, t + 1, &p);
    CHECK(p.id != ex[0] && p.id != b_id);
    ex[1] = p.id;
    registry_release(r, p.id, 0.01, false, t + 1);
    CHECK(registry_pick(r, ROLE_PREFILL, ex, 2, t + 1, &p) == 0 && p.id == b_id);
    registry_release(r, p.id, 0.01, false, t + 1);
    int seen_b = 0;
    for (int i = 0; i < 6; i++) { /* after the backoff b is back in the cycle */
        registry_pick(r, ROLE_PREFILL, NULL, 0, t + 3, &p);
        seen_b += p.id == b_id;
        registry_release(r, p.id, 0.01, false, t + 3);
    }
    CHECK(seen_b == 2);

    /* Expiry: b and c were last heard at t, a at t + 1. */
    CHECK(registry_expire(r, t + 4.9) == 0);
    CHECK(registry_live(r, ROLE_PREFILL, t + 5.5) ==
          1); /* picks see expiry even before the sweep */
    CHECK(registry_expire(r, t + 5.5) == 2);
    for (int i = 0; i < 4; i++) {
        CHECK(registry_pick(r, ROLE_PREFILL, NULL, 0, t + 5.5, &p) == 0 && !strcmp(p.http, "a:1"));
        registry_release(r, p.id, 0.01, false, t + 5.5);
    }
    CHECK(registry_pick(r, ROLE_PREFILL, NULL, 0, t + 7, &p) != 0);      /* all gone */
    CHECK(registry_live(r, ROLE_DECODE, t + 1e6) == 1);                  /* static stays */
    CHECK(registry_announce(r, ROLE_PREFILL, "b:1", "b:3", t + 8) == 1); /* back, new kv */
    CHECK(registry_pick(r, ROLE_PREFILL, NULL, 0, t + 8, &p) == 0 && !strcmp(p.kv, "b:3"));
    registry_release(r, p.id, 0.01, false, t + 8);
    registry_free(r);

    /* A full table of instances that all went away takes new ones in their
     * slots, except one a request still holds. */
    r = registry_create(&c);
    char addr[32];
    int added = 0;
    for (int i = 0; i < REG_MAX_SLOTS; i++) {
        snprintf(addr, sizeof addr, "h:%d", 10000 + i);
        added += registry_announce(r, ROLE_DECODE, addr, addr, t) == 1;
    }
    CHECK(added == REG_MAX_SLOTS);
    CHECK(registry_announce(r, ROLE_DECODE, "full:1", "full:2", t) < 0); /* all alive: full */
    reg_pick kept;
    CHECK(registry_pick(r, ROLE_DECODE, NULL, 0, t, &kept) == 0);
    CHECK(registry_expire(r, t + 10) == REG_MAX_SLOTS);
    for (int i = 0; i < REG_MAX_SLOTS - 1; i++) {
        snprintf(addr, sizeof addr, "n:%d", 20000 + i);
        if (registry_announce(r, ROLE_DECODE, addr, addr, t + 10) != 1) {
            CHECKF(0, "new instance %d of %d not taken after the old ones expired", i,
                   REG_MAX_SLOTS - 1);
            break;
        }
    }
    CHECK(registry_live(r, ROLE_DECODE, t + 10) == REG_MAX_SLOTS - 1);
    CHECK(registry_announce(r, ROLE_DECODE, "n:1", "n:1", t + 10) < 0); /* the held slot stays */
    registry_release(r, kept.id, 0.01, false, t + 10);
    CHECK(registry_announce(r, ROLE_DECODE, "n:1", "n:1", t + 10) == 1);
    registry_free(r);

    /* Least loaded: the instance with fewer requests in flight wins. */
    c.least_loaded = true;
    r = registry_create(&c);
    registry_announce(r, ROLE_DECODE, "x:1", "x:2", t);
    registry_announce(r, ROLE_DECODE, "y:1", "y:2", t);
    reg_pick held[3];
    registry_pick(r, ROLE_DECODE, NULL, 0, t, &held[0]);
    registry_pick(r, ROLE_DECODE, NULL, 0, t, &held[1]);
    CHECK(held[0].id != held[1].id);
    registry_release(r, held[1].id, 0.01, false, t); /* held[0] stays busy */
    for (int i = 0; i < 4; i++) {
        registry_pick(r, ROLE_DECODE, NULL, 0, t, &held[2]);
        CHECK(held[2].id == held[1].id);
        registry_release(r, held[2].id, 0.01, false, t);
    }
    registry_release(r, held[0].id, 0.01, false, t);
    registry_free(r);
}

static bool wait_live(registry *r, px_role role, int want, int ms) {
    for (int i = 0; i < ms / 10; i++) {
        if (registry_live(r, role, pd_now()) == want) return true;
        sleep_ms(10);
    }
    return registry_live(r, role, pd_now()) == want;
}

static void test_live(void) {
    reg_config c = {.instance_timeout = 0.4, .failure_backoff = 1, .least_loaded = false};
    registry *r = registry_create(&c);
    discovery *d = NULL;
    pd_err err;
    CHECKF(discovery_start(r, "127.0.0.1", 0, &d, &err) == 0, "%s", err.msg);
    if (!d) return registry_free(r);
    int port = discovery_port(d);
    CHECK(port > 0);

    /* A raw DEALER sends rubbish first: discovery must survive it. */
    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
    CHECK(zmq_connect(s, ep) == 0);
    zmq_send(s, "garbage", 7, 0);
    const char *unknown[] = {"type", "Q", "http_address", "1.2.3.4:5", "zmq_address", "1.2.3.4:6"};
    msgpack_sbuffer sb;
    pack_map(&sb, unknown, 3);
    zmq_send(s, sb.data, sb.size, 0);
    msgpack_sbuffer_destroy(&sb);
    zmq_send(s, "", 0, 0);

    char kv[300];
    snprintf(kv, sizeof kv,
             "{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_port\":\"14999\","
             "\"kv_ip\":\"127.0.0.1\",\"kv_connector_extra_config\":{\"proxy_ip\":\"127.0.0.1\","
             "\"proxy_port\":%d}}",
             port);
    setenv("PDSERVE_ANNOUNCE_INTERVAL_MS", "50", 1);
    announcer *a = NULL;
    kv_transfer_config kc;
    CHECKF(kv_transfer_config_parse(kv, &kc, &err) == 0, "%s", err.msg);
    CHECKF(announcer_start_for_instance(&kc, "127.0.0.1:14999", "127.0.0.1", 8123, &a, &err) == 0, "%s", err.msg);
    CHECK(a != NULL);
    CHECK(wait_live(r, ROLE_PREFILL, 1, 3000));
    CHECK(wait_live(r, ROLE_DECODE, 1, 3000));
    reg_pick p;
    CHECK(registry_pick(r, ROLE_DECODE, NULL, 0, pd_now(), &p) == 0 &&
          !strcmp(p.http, "127.0.0.1:8123") && !strcmp(p.kv, "127.0.0.1:14999"));
    registry_unpick(r, p.id);
    /* The rubbish travels on another socket than the announcer's, so it may
     * arrive after the instance went live: wait for it (bounded). */
    unsigned long long acc = 0, rej = 0;
    for (int i = 0; i < 300; i++) {
        discovery_counts(d, &acc, &rej);
        if (rej >= 3) break;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    CHECKF(rej == 3, "rejected %llu", rej);
    CHECK(acc >= 2);

    /* The instance leaves: gone after the timeout (plus one sweep). */
    announcer_stop(a);
    double t0 = pd_now();
    CHECK(wait_live(r, ROLE_PREFILL, 0, 2000) && wait_live(r, ROLE_DECODE, 0, 2000));
    CHECK(pd_now() - t0 < 1.5);
    /* The discovery thread sweeps expired entries by itself (it may run a
     * moment after they stopped counting as live). */
    int held = registry_size(r);
    for (int i = 0; i < 200 && held > 0; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
        held = registry_size(r);
    }
    CHECKF(held == 0, "%d expired entries were not swept by the discovery thread", held);

    /* No proxy in the config: no announcer and no error. */
    CHECK(kv_transfer_config_parse("{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_producer\"}", &kc,
                                   &err) == 0);
    CHECK(announcer_start_for_instance(&kc, "127.0.0.1:1", NULL, 1, &a, &err) == 0 && a == NULL);

    zmq_close(s);
    zmq_ctx_term(ctx);
    discovery_stop(d);
    registry_free(r);
}

int main(void) {
    test_round_trip();
    test_bad_messages();
    test_registry();
    test_live();
    return test_finish();
}
