/* pd_httpd: shared libmicrohttpd plumbing. See pd_httpd.h. */
#include "common/pd_httpd.h"

#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char msg[400];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r'))
        msg[--n] = 0;
    pd_log(PD_LOG_DEBUG, "libmicrohttpd: %s", msg);
}

int pd_httpd_start(pd_httpd *h, const char *host, int port, unsigned idle_timeout_s,
                   MHD_AccessHandlerCallback on_request, void *cls,
                   MHD_RequestCompletedCallback on_completed, pd_err *err) {
    memset(h, 0, sizeof *h);
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                     MHD_USE_POLL | MHD_USE_ITC | MHD_USE_ERROR_LOG;
    struct addrinfo *ai = NULL;
    if (host && host[0]) {
        char port_s[16];
        snprintf(port_s, sizeof port_s, "%d", port);
        struct addrinfo hints = {
            .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
        int rc = getaddrinfo(host, port_s, &hints, &ai);
        if (rc != 0) return pd_fail(err, "--host %s: %s", host, gai_strerror(rc));
        if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    }
    struct MHD_OptionItem opts[] = {
        {MHD_OPTION_NOTIFY_COMPLETED, (intptr_t)on_completed, cls},
        {MHD_OPTION_EXTERNAL_LOGGER, (intptr_t)on_mhd_log, NULL},
        {MHD_OPTION_CONNECTION_TIMEOUT, (intptr_t)idle_timeout_s, NULL},
        {MHD_OPTION_CONNECTION_LIMIT, 4096, NULL},
        {MHD_OPTION_THREAD_STACK_SIZE, 1 << 20, NULL},
        {MHD_OPTION_LISTENING_ADDRESS_REUSE, 1, NULL},
        {MHD_OPTION_LISTEN_BACKLOG_SIZE, 1024, NULL},
        {ai ? MHD_OPTION_SOCK_ADDR : MHD_OPTION_END, 0, ai ? ai->ai_addr : NULL},
        {MHD_OPTION_END, 0, NULL},
    };
    h->daemon = MHD_start_daemon(flags, (uint16_t)port, NULL, NULL, on_request, cls,
                                 MHD_OPTION_ARRAY, opts, MHD_OPTION_END);
    if (ai) freeaddrinfo(ai);
    if (!h->daemon)
        return pd_fail(err, "cannot listen on %s:%d (address in use?)", host ? host : "0.0.0.0",
                       port);
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->daemon, MHD_DAEMON_INFO_BIND_PORT);
    h->port = di ? di->port : port;
    return 0;
}

void pd_httpd_quiesce(pd_httpd *h) {
    if (h->quiesced) return;
    MHD_socket fd = MHD_quiesce_daemon(h->daemon);
    if (fd != MHD_INVALID_SOCKET) close(fd);
    h->quiesced = true;
}

void pd_httpd_stop(pd_httpd *h) {
    if (h->daemon) MHD_stop_daemon(h->daemon);
    h->daemon = NULL;
}

bool pd_httpd_client_gone(struct MHD_Connection *conn) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return false;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLIN | POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
    if (p.revents & POLLIN) { /* readable: EOF, or the client pipelined its next request */
        char c;
        return recv(ci->connect_fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
    }
    return false;
}

int pd_httpd_body_read(void **con_cls, const char *upload_data, size_t *upload_size,
                       size_t max_bytes, pd_httpd_body **out) {
    pd_httpd_body *bs = *con_cls;
    if (!bs) { /* first call: only the headers are here */
        bs = calloc(1, sizeof *bs);
        if (!bs) return -1;
        pd_buf_init(&bs->body);
        *con_cls = bs;
        return 0;
    }
    if (*upload_size) {
        if (!bs->too_large && bs->body.len + *upload_size > max_bytes) {
            bs->too_large = true;
            pd_buf_free(&bs->body);
        }
        if (!bs->too_large) pd_buf_append(&bs->body, upload_data, *upload_size);
        *upload_size = 0;
        return 0;
    }
    *out = bs;
    return 1;
}

void pd_httpd_body_free(void **con_cls) {
    pd_httpd_body *bs = *con_cls;
    if (bs) {
        pd_buf_free(&bs->body);
        free(bs);
    }
    *con_cls = NULL;
}

enum MHD_Result pd_httpd_send(struct MHD_Connection *conn, unsigned status, struct MHD_Response *resp,
                              bool close) {
    if (close || !resp) {
        if (resp) MHD_destroy_response(resp);
        return MHD_NO;
    }
    enum MHD_Result rc = MHD_queue_response(conn, status, resp);
    MHD_destroy_response(resp);
    return rc;
}
