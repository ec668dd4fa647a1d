/* pdproxy: the bundled disaggregation proxy. Parses the flags, fills the
 * registry with static instances, starts discovery (ZMQ) and the HTTP
 * front, and waits for SIGINT/SIGTERM; then stops taking connections, lets
 * requests in flight finish for --shutdown-timeout seconds, cancels the
 * rest and tears down. See docs/proxy.md. */
#include <curl/curl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "proxy/discovery.h"
#include "proxy/front.h"
#include "proxy/metrics.h"
#include "proxy/registry.h"
#include "proxy/upstream.h"
#include "server/cli.h"

#define MAX_STATIC 256

typedef struct proxy_options {
    const char *host, *discovery_host, *api_key, *upstream_api_key, *routing, *log_level;
    int port, discovery_port, help;
    float instance_timeout, timeout, connect_timeout, failure_backoff, shutdown_timeout;
    float max_body_mb;
} proxy_options;

#define O(f) offsetof(proxy_options, f)
static const cli_option table[] = {
    {"host", CLI_STR, O(host), NULL, 1, 0, "address for the HTTP front (default: all)"},
    {"port", CLI_INT, O(port), "10001", 0, 65535, "HTTP port (0: any free port)"},
    {"discovery-port", CLI_INT, O(discovery_port), "30001", 0, 65535,
     "ZMQ ROUTER port for instance announcements (0: no discovery)"},
    {"discovery-host", CLI_STR, O(discovery_host), NULL, 1, 0,
     "address for the discovery socket (default: all)"},
    {"instance-timeout", CLI_FLOAT, O(instance_timeout), "5", 0.05, 3600,
     "seconds after its last announcement an instance is dropped"},
    {"routing", CLI_STR, O(routing), "round-robin", 1, 0, "round-robin or least-loaded"},
    {"timeout", CLI_FLOAT, O(timeout), "300", 0.1, 86400,
     "seconds a client request may take end to end (then 504)"},
    {"connect-timeout", CLI_FLOAT, O(connect_timeout), "3", 0.01, 600,
     "seconds to connect to an instance"},
    {"failure-backoff", CLI_FLOAT, O(failure_backoff), "2", 0, 3600,
     "seconds an instance that failed a request is avoided while others are available"},
    {"api-key", CLI_STR, O(api_key), NULL, 1, 0,
     "require `Authorization: Bearer KEY` on /v1/* (or env PDPROXY_API_KEY)"},
    {"upstream-api-key", CLI_STR, O(upstream_api_key), NULL, 1, 0,
     "send `Authorization: Bearer KEY` to the instances (default: pass the client's header "
     "on when there is no --api-key)"},
    {"max-body-mb", CLI_FLOAT, O(max_body_mb), "4", 0.001, 1024, "largest request body (413)"},
    {"shutdown-timeout", CLI_FLOAT, O(shutdown_timeout), "10", 0, 3600,
     "seconds requests in flight may run after SIGINT/SIGTERM"},
    {"log-level", CLI_STR, O(log_level), "info", 1, 0, "debug, info, warning, error"},
    {"help", CLI_BOOL, O(help), "false", 1, 0, "show this help"},
};
#define N_OPTS ((int)(sizeof table / sizeof table[0]))

typedef struct static_list {
    char *items[MAX_STATIC];
    px_role roles[MAX_STATIC];
    int n;
} static_list;

/* Take --prefill/--decode out of argv (cli_parse knows only single values):
 * each takes one or more following values, HTTP_ADDR[,KV_ADDR], and may be
 * repeated. The rest of argv is compacted into rest[]. */
static int take_static(int argc, char **argv, static_list *sl, char **rest, int *n_rest,
                       pd_err *err) {
    *n_rest = 0;
    for (int a = 0; a < argc; a++) {
        const char *arg = argv[a];
        int role = -1;
        const char *eq = NULL;
        for (int k = 0; k < 2 && role < 0; k++) {
            const char *name = k == 0 ? "--prefill" : "--decode";
            size_t n = strlen(name);
            if (!strncmp(arg, name, n) && (arg[n] == 0 || arg[n] == '=')) {
                role = k;
                eq = arg[n] == '=' ? arg + n + 1 : NULL;
            }
        }
        if (role < 0) {
            rest[(*n_rest)++] = argv[a];
            continue;
        }
        int got = 0;
        if (eq) {
            if (sl->n >= MAX_STATIC) return pd_fail(err, "too many --prefill/--decode values");
            sl->roles[sl->n] = (px_role)role;
            sl->items[sl->n++] = (char *)eq;
            got = 1;
        }
        while (!eq && a + 1 < argc && strncmp(argv[a + 1], "--", 2) != 0) {
            if (sl->n >= MAX_STATIC) return pd_fail(err, "too many --prefill/--decode values");
            sl->roles[sl->n] = (px_role)role;
            sl->items[sl->n++] = argv[++a];
            got++;
        }
        if (!got) return pd_fail(err, "%s needs a value HTTP_ADDR[,KV_ADDR]", arg);
    }
    return 0;
}

static int add_static(registry *reg, const static_list *sl, pd_err *err) {
    for (int i = 0; i < sl->n; i++) {
        char item[2 * REG_ADDR_MAX + 2];
        snprintf(item, sizeof item, "%s", sl->items[i]);
        char *comma = strchr(item, ',');
        char *kv = NULL;
        if (comma) {
            *comma = 0;
            kv = comma + 1;
            if (strchr(kv, ','))
                return pd_fail(err,
                               "--%s %s: one instance per value, HTTP_ADDR[,KV_ADDR] (give more "
                               "instances as more values or repeat the flag)",
                               px_role_name(sl->roles[i]), sl->items[i]);
        }
        if (registry_add_static(reg, sl->roles[i], item, kv, err) != 0)
            return pd_wrap(err, "--%s", px_role_name(sl->roles[i]));
        pd_log(PD_LOG_INFO, "static %s instance %s", px_role_name(sl->roles[i]), sl->items[i]);
    }
    return 0;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

int main(int argc, char **argv) {
    static_list sl = {0};
    char **rest = calloc((size_t)argc + 1, sizeof *rest);
    proxy_options o;
    pd_err err = {{0}};
    int n_rest = 0, n_pos = 0;
    char *pos[1];
    if (!rest) return 1;
    if (take_static(argc - 1, argv + 1, &sl, rest, &n_rest, &err) != 0 ||
        cli_parse(table, N_OPTS, &o, n_rest, rest, pos, 0, &n_pos, NULL, &err) != 0) {
        fprintf(stderr, "pdproxy: %s\n", err.msg);
        free(rest);
        return 2;
    }
    if (o.help) {
        cli_print_help("pdproxy [--prefill HTTP_ADDR[,KV_ADDR]...] [--decode ...] [flags]", table,
                       N_OPTS);
        printf("  %-28s %s\n  %-28s %s\n", "--prefill ADDR...",
               "static prefill instance(s): HTTP_ADDR[,KV_ADDR]; repeatable, never expire",
               "--decode ADDR...", "static decode instance(s), the same way");
        free(rest);
        return 0;
    }
    pd_log_level lvl;
    if (pd_log_parse_level(o.log_level, &lvl) != 0) {
        fprintf(stderr, "pdproxy: --log-level: '%s' is not debug, info, warning or error\n",
                o.log_level);
        free(rest);
        return 2;
    }
    pd_log_set_level(lvl);
    bool least = !strcmp(o.routing, "least-loaded");
    if (!least && strcmp(o.routing, "round-robin")) {
        fprintf(stderr, "pdproxy: --routing: '%s' is not round-robin or least-loaded\n", o.routing);
        free(rest);
        return 2;
    }
    if (!o.api_key) o.api_key = getenv("PDPROXY_API_KEY");
    if (o.discovery_port == 0 && sl.n == 0)
        pd_log(PD_LOG_WARN, "no discovery and no static instances: every request gets 503");

    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
    curl_global_init(CURL_GLOBAL_DEFAULT);

    reg_config rc = {o.instance_timeout, o.failure_backoff, least};
    registry *reg = registry_create(&rc);
    upstream_pool *pool = upstream_pool_create(o.connect_timeout);
    proxy_metrics pm;
    pxm_init(&pm);
    discovery *disc = NULL;
    front *fr = NULL;
    int status = 1;
    if (!reg || !pool) {
        fprintf(stderr, "pdproxy: out of memory\n");
        goto out;
    }
    if (add_static(reg, &sl, &err) != 0) {
        fprintf(stderr, "pdproxy: %s\n", err.msg);
        status = 2;
        goto out;
    }
    if (o.discovery_port &&
        discovery_start(reg, o.discovery_host, o.discovery_port, &disc, &err) != 0) {
        fprintf(stderr, "pdproxy: %s\n", err.msg);
        goto out;
    }
    front_config fc = {
        .host = o.host,
        .port = o.port,
        .api_key = o.api_key,
        .upstream_api_key = o.upstream_api_key,
        .timeout = o.timeout,
        .max_body_bytes = (size_t)(o.max_body_mb * 1024 * 1024),
    };
    if (front_start(&fc, reg, pool, &pm, disc, &fr, &err) != 0) {
        fprintf(stderr, "pdproxy: %s\n", err.msg);
        goto out;
    }
    char disc_txt[32] = "off";
    if (disc) snprintf(disc_txt, sizeof disc_txt, "on port %d", discovery_port(disc));
    pd_log(PD_LOG_INFO,
           "pdproxy on http://%s:%d (discovery %s, routing %s, instance timeout %.1f s, "
           "request timeout %.0f s)",
           o.host ? o.host : "0.0.0.0", front_port(fr), disc_txt, o.routing,
           (double)o.instance_timeout, (double)o.timeout);

    int sig = 0;
    while (sigwait(&sigs, &sig) != 0) {
    }
    pd_log(PD_LOG_INFO, "%s: stopping (%d requests in flight, up to %.0f s)",
           sig == SIGINT ? "SIGINT" : "SIGTERM", front_active(fr), (double)o.shutdown_timeout);
    front_quiesce(fr);
    double end = pd_now() + o.shutdown_timeout;
    while (front_active(fr) > 0 && pd_now() < end)
        sleep_ms(20);
    status = 0;
out:
    front_stop(fr);
    discovery_stop(disc);
    upstream_pool_free(pool);
    registry_free(reg);
    pxm_destroy(&pm);
    curl_global_cleanup();
    free(rest);
    if (status == 0) pd_log(PD_LOG_INFO, "stopped");
    return status;
}
