/* The native reader's source (kvstore/ucx_native.c) with one more entry point, for a test only: it spoils the
 * session key a client holds for one server, so that the client's next READ on that connection is signed as a
 * peer would sign it that names a proven connection's endpoint without holding its key. The server must drop
 * such a READ unanswered. Used by tests/kvstore/test_ucx_native.py. */
#include "../../kvstore/ucx_native.c"

/* 0 once the key of the client's connection to host:port is spoiled; -1 if the client has no such connection. */
int rt_test_spoil_session(void *handle, const char *host, int port) {
    client_t *c = handle;
    pthread_mutex_lock(&c->lock);
    int found = -1;
    for (cconn_t *conn = c->conns; conn; conn = conn->next)
        if (conn->port == port && strcmp(conn->host, host) == 0) {
            conn->session[0] ^= 0x01;
            found = 0;
        }
    pthread_mutex_unlock(&c->lock);
    return found;
}
