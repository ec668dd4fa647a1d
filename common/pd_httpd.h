/* pd_httpd: the libmicrohttpd plumbing that pdserve's HTTP server
 * (server/http.c) and pdproxy's front (proxy/front.c) share — starting a
 * thread-per-connection daemon on host:port, collecting request bodies with a
 * size limit, noticing a client that hung up, and quiescing. Routing and
 * replies stay with each program. */
#ifndef PD_HTTPD_H
#define PD_HTTPD_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <microhttpd.h>

#include "common/pd_buf.h"
#include "common/pd_common.h"

typedef struct pd_httpd {
    struct MHD_Daemon *daemon;
    int port; /* the bound port (the real one when 0 was asked for) */
    bool quiesced;
} pd_httpd;

/* Listen on host:port (host NULL or "": all interfaces; port 0: any free
 * port), one thread per connection. idle_timeout_s must outlast the quietest
 * stretch of a streamed answer. on_completed runs when a request ends (where
 * pd_httpd_body_free belongs). libmicrohttpd's own
 * messages go to pd_log at debug level. */
int pd_httpd_start(pd_httpd *h, const char *host, int port, unsigned idle_timeout_s,
                   MHD_AccessHandlerCallback on_request, void *cls,
                   MHD_RequestCompletedCallback on_completed, pd_err *err);
/* Stop accepting connections; requests in flight continue. Idempotent. */
void pd_httpd_quiesce(pd_httpd *h);
void pd_httpd_stop(pd_httpd *h);

/* True when the client of conn has closed its side (checked without blocking). */
bool pd_httpd_client_gone(struct MHD_Connection *conn);

/* A request body as it arrives, kept in the connection's con_cls. Past the
 * limit the bytes are dropped and too_large is set, so the handler can answer
 * 413 once the upload is over. */
typedef struct pd_httpd_body {
    pd_buf body;
    bool too_large;
    bool answering; /* for the owner: set when its handler took the request */
} pd_httpd_body;

/* Call at the top of an access handler with its con_cls/upload arguments.
 * Returns 1 with *out set once the whole body is in; 0 when the handler
 * should return MHD_YES (headers only so far, or a chunk was taken); -1 when
 * it should return MHD_NO (out of memory). */
int pd_httpd_body_read(void **con_cls, const char *upload_data, size_t *upload_size,
                       size_t max_bytes, pd_httpd_body **out);
/* Free the body kept in *con_cls (from the request-completed callback). */
void pd_httpd_body_free(void **con_cls);

/* The last step of an access handler: queue resp with status and release our
 * reference to it, or (close, or no response) drop the connection. */
enum MHD_Result pd_httpd_send(struct MHD_Connection *conn, unsigned status, struct MHD_Response *resp,
                              bool close);

#endif
