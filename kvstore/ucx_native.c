/*
 * rayturn KV store: reads of a segment over UCX, served and waited for in native code.
 *
 * A segment owner runs one server thread with a UCP worker of its own, bound to the address the
 * segment advertises. A reader's client owns another worker and waits on the calling thread (the
 * caller's GIL is released by ctypes). No Python runs between UCX and the segment on either side.
 *
 * Active messages (ids below). Every connection first proves the store secret, the same
 * challenge-response as the Python server (rayturn.kvstore.access):
 *
 *   client --HELLO-------------------------------------> server
 *   client <--CHALLENGE {S}----------------------------- server
 *   client --AUTH {C, HMAC(peer key, "client" S C)}----> server
 *   client <--AUTH_OK {HMAC(peer key, "server" S C)}---- server   (reads follow)
 *          <--REFUSED {message}, hang up-----------------         (wrong proof, none in time)
 *
 *   client --READ {request id, HMAC(session key, request id, body)} body--> server
 *   client <--READ_REPLY {request id, status, bytes} data-- server
 *
 * UCX names a message's connection (its reply endpoint) from an id the sender writes, so the server
 * trusts no message for whose connection it says it is: the handshake's messages only move that
 * connection's own handshake along, and every READ is signed with the connection's session key
 * (HMAC(peer key, "session" S C), known to its two ends only). Anything out of order, unsigned or
 * signed with another key is dropped unanswered (and counted); a connection still unproven after
 * HANDSHAKE_NS is refused and hung up.
 *
 * A READ's body (little endian): u32 n, n x (i64 offset, i64 length) requested; u32 m,
 * m x (i64 offset, i64 length) granted (sorted by offset); f64 expires_at; u32 k, k bytes of epoch;
 * 32 bytes of the grant's HMAC (grant key, the length-prefixed parts "read", segment id, epoch,
 * expires_at, granted ranges). The server checks it as SegmentGate.check_read does; a refusal
 * carries the reason as its data, a reply the requested ranges straight out of the segment.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

enum { AM_HELLO = 1, AM_AUTH = 2, AM_READ = 3, AM_CHALLENGE = 11, AM_AUTH_OK = 12, AM_REFUSED = 13, AM_READ_REPLY = 14 };
enum { KEY = 32, NONCE = 32, MAX_CONNS = 256, MAX_UNPROVEN = 64, MAX_RANGES = 1024, MAX_EPOCH = 256, MSG = 256 };
enum { READ_OK = 0, READ_REFUSED = 1, READ_TIMEOUT = 2, READ_FAILED = 3 };
#define HANDSHAKE_NS 5000000000LL
#define REFUSED_CLOSE_NS 100000000LL
#define SERVER_SPIN_NS 300000LL
#define CLIENT_SPIN_NS 50000LL

static int64_t now_ns(int clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void say(char *out, size_t size, const char *fmt, ...) {
    if (!out || !size) return;
    va_list args;
    va_start(args, fmt);
    vsnprintf(out, size, fmt, args);
    va_end(args);
}

/* ---- SHA-256 and HMAC-SHA256 (FIPS 180-4, RFC 2104) ------------------------------------------ */

typedef struct {
    uint32_t h[8];
    uint64_t bytes;
    uint8_t block[64];
    size_t used;
} sha256_t;

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(sha256_t *s, const uint8_t *p) {
    uint32_t w[64], a, b, c, d, e, f, g, h;
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = s->h[0], b = s->h[1], c = s->h[2], d = s->h[3], e = s->h[4], f = s->h[5], g = s->h[6], h = s->h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
        uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    s->h[0] += a, s->h[1] += b, s->h[2] += c, s->h[3] += d, s->h[4] += e, s->h[5] += f, s->h[6] += g, s->h[7] += h;
}

static void sha256_init(sha256_t *s) {
    static const uint32_t init[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                     0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, init, sizeof init);
    s->bytes = 0;
    s->used = 0;
}

static void sha256_update(sha256_t *s, const void *data, size_t len) {
    const uint8_t *p = data;
    s->bytes += len;
    while (len) {
        size_t take = 64 - s->used < len ? 64 - s->used : len;
        memcpy(s->block + s->used, p, take);
        s->used += take, p += take, len -= take;
        if (s->used == 64) sha256_block(s, s->block), s->used = 0;
    }
}

static void sha256_final(sha256_t *s, uint8_t out[32]) {
    uint64_t bits = s->bytes * 8;
    uint8_t pad = 0x80, zero = 0, length[8];
    sha256_update(s, &pad, 1);
    while (s->used != 56) sha256_update(s, &zero, 1);
    for (int i = 0; i < 8; i++) length[i] = (uint8_t)(bits >> (56 - 8 * i));
    sha256_update(s, length, 8);
    for (int i = 0; i < 8; i++)
        out[4 * i] = s->h[i] >> 24, out[4 * i + 1] = s->h[i] >> 16, out[4 * i + 2] = s->h[i] >> 8, out[4 * i + 3] = s->h[i];
}

typedef struct {
    sha256_t inner;
    uint8_t okey[64];
} hmac_t;

static void hmac_start(hmac_t *m, const uint8_t key[KEY]) {
    uint8_t ikey[64];
    memset(ikey, 0x36, 64);
    memset(m->okey, 0x5c, 64);
    for (int i = 0; i < KEY; i++) ikey[i] ^= key[i], m->okey[i] ^= key[i];
    sha256_init(&m->inner);
    sha256_update(&m->inner, ikey, 64);
}

static void hmac_finish(hmac_t *m, uint8_t out[32]) {
    uint8_t digest[32];
    sha256_t outer;
    sha256_final(&m->inner, digest);
    sha256_init(&outer);
    sha256_update(&outer, m->okey, 64);
    sha256_update(&outer, digest, 32);
    sha256_final(&outer, out);
}

static void hmac_part(hmac_t *m, const void *part, uint32_t len) { /* a length-prefixed part, as access._sign */
    uint8_t prefix[4] = {(uint8_t)len, (uint8_t)(len >> 8), (uint8_t)(len >> 16), (uint8_t)(len >> 24)};
    sha256_update(&m->inner, prefix, 4);
    sha256_update(&m->inner, part, len);
}

static void proof(const uint8_t key[KEY], const char *side, const uint8_t *s, const uint8_t *c, uint8_t out[32]) {
    hmac_t m;
    hmac_start(&m, key);
    sha256_update(&m.inner, side, strlen(side));
    sha256_update(&m.inner, s, NONCE);
    sha256_update(&m.inner, c, NONCE);
    hmac_finish(&m, out);
}

static int equal_ct(const uint8_t *a, const uint8_t *b, size_t n) {
    uint8_t diff = 0;
    for (size_t i = 0; i < n; i++) diff |= a[i] ^ b[i];
    return diff == 0;
}

/* exported for the test that checks this HMAC against Python's */
void rt_hmac_sha256(const uint8_t key[KEY], const uint8_t *data, uint64_t len, uint8_t out[32]) {
    hmac_t m;
    hmac_start(&m, key);
    sha256_update(&m.inner, data, len);
    hmac_finish(&m, out);
}

/* ---- shared helpers -------------------------------------------------------------------------- */

typedef struct {
    uint64_t request_id;
    uint32_t status;
    uint32_t reserved;
    uint64_t bytes;
} reply_header_t;

typedef struct {
    void *request;
    int done;
    ucs_status_t status;
} wait_t;

static void sent_cb(void *request, ucs_status_t status, void *user_data) {
    (void)status;
    free(user_data); /* the send's iov (and copied data) */
    ucp_request_free(request);
}

static int make_sockaddr(const char *host, int port, struct sockaddr_storage *addr, socklen_t *len) {
    memset(addr, 0, sizeof *addr);
    struct sockaddr_in *v4 = (struct sockaddr_in *)addr;
    struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)addr;
    if (inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET, v4->sin_port = htons((uint16_t)port), *len = sizeof *v4;
        return 0;
    }
    if (inet_pton(AF_INET6, host, &v6->sin6_addr) == 1) {
        v6->sin6_family = AF_INET6, v6->sin6_port = htons((uint16_t)port), *len = sizeof *v6;
        return 0;
    }
    return -1;
}

static ucs_status_t make_worker(ucp_context_h *context, ucp_worker_h *worker, ucs_thread_mode_t mode, int *efd) {
    ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP};
    ucp_config_t *config;
    ucs_status_t status = ucp_config_read(NULL, NULL, &config);
    if (status != UCS_OK) return status;
    /* UCX's TCP transport writes a "put" to whatever address its sender names, whatever the context's
     * features: never in a process a stranger can connect to (as ucx_runtime._UCX_REQUIRED). */
    status = ucp_config_modify(config, "TCP_PUT_ENABLE", "n");
    if (status == UCS_OK) status = ucp_init(&params, config, context);
    ucp_config_release(config);
    if (status != UCS_OK) return status;
    ucp_worker_params_t wparams = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = mode};
    status = ucp_worker_create(*context, &wparams, worker);
    if (status == UCS_OK) status = ucp_worker_get_efd(*worker, efd);
    if (status != UCS_OK) {
        if (*worker) ucp_worker_destroy(*worker);
        ucp_cleanup(*context);
        *worker = NULL;
    }
    return status;
}

static ucs_status_t set_handler(ucp_worker_h worker, unsigned id, ucp_am_recv_callback_t cb, void *arg) {
    ucp_am_handler_param_t p = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                      UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
        .id = id,
        .flags = UCP_AM_FLAG_WHOLE_MSG,
        .cb = cb,
        .arg = arg};
    return ucp_worker_set_am_recv_handler(worker, &p);
}

/* Post an active message; the send owns a copy of the header and of the iov (and, with copy_data, of the
 * bytes it points at: for data that does not outlive the caller). 0 when posted (or done), -1 if refused. */
static int post_am(ucp_ep_h ep, unsigned id, const void *header, size_t header_len, const ucp_dt_iov_t *iov,
                   size_t count, unsigned flags, int copy_data) {
    ucp_dt_iov_t *copy = NULL;
    if (count) {
        size_t data_bytes = 0;
        for (size_t i = 0; copy_data && i < count; i++) data_bytes += iov[i].length;
        copy = malloc(count * sizeof *copy + data_bytes);
        if (!copy) return -1;
        memcpy(copy, iov, count * sizeof *copy);
        uint8_t *bytes = (uint8_t *)(copy + count);
        for (size_t i = 0; copy_data && i < count; i++) {
            memcpy(bytes, iov[i].buffer, iov[i].length);
            copy[i].buffer = bytes;
            bytes += iov[i].length;
        }
    }
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                                             UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_DATATYPE,
                             .cb.send = sent_cb,
                             .user_data = copy,
                             .flags = flags | UCP_AM_SEND_FLAG_COPY_HEADER,
                             .datatype = ucp_dt_make_iov()};
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, header, header_len, copy, count, &p);
    if (r == NULL) {
        free(copy);
        return 0;
    }
    if (UCS_PTR_IS_ERR(r)) {
        free(copy);
        return -1;
    }
    return 0; /* sent_cb frees the iov and the request when the send completes (or its endpoint closes) */
}

static void *close_ep(ucp_worker_h worker, ucp_ep_h ep) {
    (void)worker;
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
    return UCS_PTR_IS_PTR(r) ? r : NULL;
}

/* ---- server ------------------------------------------------------------------------------------ */

typedef struct server server_t;

typedef struct {
    server_t *server;
    ucp_ep_h ep;
    void *closing; /* the close request while the endpoint goes */
    int state;     /* 0 free, 1 connected, 2 challenged, 3 proven, 4 closing, 5 refused (closed soon) */
    int64_t since_ns;
    uint8_t nonce[NONCE];
    uint8_t session[KEY]; /* once proven: the key every READ of this connection is signed with */
} sconn_t;

struct server {
    ucp_context_h context;
    ucp_worker_h worker;
    ucp_listener_h listener;
    int efd, stopfd, port, started;
    pthread_t thread;
    pthread_mutex_t lock; /* keys and epoch: set by Python threads, read by the server's */
    uint8_t peer_key[KEY], grant_key[KEY];
    char epoch[MAX_EPOCH];
    char segment_id[MAX_EPOCH];
    uint8_t *segment;
    uint64_t capacity;
    char host[64];
    char error[MSG];
    sconn_t conns[MAX_CONNS];
    volatile int stop;
    uint64_t served, refused, accepted, rejected;
};

static sconn_t *find_conn(server_t *s, ucp_ep_h ep) {
    if (!ep) return NULL;
    for (int i = 0; i < MAX_CONNS; i++)
        if (s->conns[i].state >= 1 && s->conns[i].state <= 3 && s->conns[i].ep == ep) return &s->conns[i];
    return NULL;
}

static void drop_conn(sconn_t *c) {
    if (c->state == 0 || c->state == 4) return;
    c->state = 4;
    c->closing = close_ep(c->server->worker, c->ep);
    if (!c->closing) c->state = 0;
}

/* Tell the peer why; with hang_up, ignore it from now on and close its endpoint a moment later (housekeeping),
 * so that the refusal has left before the close. */
static void refuse(sconn_t *c, const char *why, int hang_up) {
    ucp_dt_iov_t iov = {.buffer = (void *)why, .length = strlen(why)};
    __atomic_add_fetch(&c->server->refused, 1, __ATOMIC_RELAXED);
    post_am(c->ep, AM_REFUSED, NULL, 0, &iov, 1, UCP_AM_SEND_FLAG_EAGER, 1);
    if (hang_up && c->state >= 1 && c->state <= 3) c->state = 5, c->since_ns = now_ns(CLOCK_MONOTONIC);
}

/* Closed by the next housekeeping, outside UCX's callbacks. */
static void close_soon(sconn_t *c) {
    if (c->state >= 1 && c->state <= 3) c->state = 5, c->since_ns = now_ns(CLOCK_MONOTONIC) - REFUSED_CLOSE_NS;
}

static void server_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep, (void)status;
    close_soon(arg);
}

/* A message that cannot be this connection's: dropped unanswered (it may name another's endpoint). */
static ucs_status_t ignore(server_t *s) {
    __atomic_add_fetch(&s->refused, 1, __ATOMIC_RELAXED);
    return UCS_OK;
}

static void server_conn(ucp_conn_request_h request, void *arg) {
    server_t *s = arg;
    int unproven = 0;
    sconn_t *slot = NULL;
    for (int i = 0; i < MAX_CONNS; i++) {
        if (s->conns[i].state == 0 && !slot) slot = &s->conns[i];
        if (s->conns[i].state == 1 || s->conns[i].state == 2 || s->conns[i].state == 5) unproven++;
    }
    if (s->stop || !slot || unproven >= MAX_UNPROVEN) {
        s->rejected++;
        ucp_listener_reject(s->listener, request);
        return;
    }
    ucp_ep_params_t p = {.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                                       UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                         .conn_request = request,
                         .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                         .err_handler = {.cb = server_ep_error, .arg = slot}};
    memset(slot, 0, sizeof *slot);
    slot->server = s;
    if (ucp_ep_create(s->worker, &p, &slot->ep) != UCS_OK) return;
    slot->state = 1;
    slot->since_ns = now_ns(CLOCK_MONOTONIC);
    s->accepted++;
}

static ucs_status_t on_hello(void *arg, const void *header, size_t header_len, void *data, size_t len,
                             const ucp_am_recv_param_t *param) {
    (void)header, (void)header_len, (void)data, (void)len;
    server_t *s = arg;
    sconn_t *c = find_conn(s, (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : NULL);
    if (!c || c->state != 1 || getrandom(c->nonce, NONCE, 0) != NONCE) return ignore(s);
    c->state = 2;
    post_am(c->ep, AM_CHALLENGE, c->nonce, NONCE, NULL, 0, UCP_AM_SEND_FLAG_EAGER, 0);
    return UCS_OK;
}

static ucs_status_t on_auth(void *arg, const void *header, size_t header_len, void *data, size_t len,
                            const ucp_am_recv_param_t *param) {
    (void)data, (void)len;
    server_t *s = arg;
    sconn_t *c = find_conn(s, (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : NULL);
    uint8_t expected[32], reply[32], key[KEY];
    if (!c || c->state != 2 || header_len != NONCE + 32) return ignore(s);
    pthread_mutex_lock(&s->lock);
    memcpy(key, s->peer_key, KEY);
    pthread_mutex_unlock(&s->lock);
    const uint8_t *client_nonce = header, *client_proof = (const uint8_t *)header + NONCE;
    proof(key, "client", c->nonce, client_nonce, expected);
    if (!equal_ct(expected, client_proof, 32)) return ignore(s); /* refused at the handshake's deadline */
    proof(key, "server", c->nonce, client_nonce, reply);
    proof(key, "session", c->nonce, client_nonce, c->session);
    c->state = 3;
    post_am(c->ep, AM_AUTH_OK, reply, 32, NULL, 0, UCP_AM_SEND_FLAG_EAGER, 0);
    return UCS_OK;
}

typedef struct {
    const uint8_t *p, *end;
} cursor_t;

static int take(cursor_t *c, void *out, size_t n) {
    if ((size_t)(c->end - c->p) < n) return -1;
    if (out) memcpy(out, c->p, n);
    c->p += n;
    return 0;
}

static int range_cmp(const void *key, const void *row) {
    int64_t a = ((const int64_t *)key)[0], b = ((const int64_t *)row)[0];
    return a < b ? -1 : a > b;
}

/* Checks a READ as SegmentGate.check_read and UcxServer._check_request do; 0, or -1 with why. */
static int check_read(server_t *s, const uint8_t *body, size_t len, const int64_t **ranges, uint32_t *count,
                      uint64_t *total, char *why) {
    cursor_t c = {body, body + len};
    uint32_t n, m, k;
    double expires_at;
    uint8_t mac[32], expected[32], grant_key[KEY];
    char epoch[MAX_EPOCH];
    if (take(&c, &n, 4) || n == 0 || n > MAX_RANGES || (size_t)(c.end - c.p) < (size_t)n * 16) goto malformed;
    const uint8_t *requested = c.p;
    c.p += (size_t)n * 16;
    if (take(&c, &m, 4) || m > MAX_RANGES || (size_t)(c.end - c.p) < (size_t)m * 16) goto malformed;
    const uint8_t *granted = c.p;
    c.p += (size_t)m * 16;
    if (take(&c, &expires_at, 8) || take(&c, &k, 4) || k >= MAX_EPOCH || take(&c, epoch, k)) goto malformed;
    epoch[k] = 0;
    if (take(&c, mac, 32) || c.p != c.end) goto malformed;
    pthread_mutex_lock(&s->lock);
    memcpy(grant_key, s->grant_key, KEY);
    int same_epoch = s->epoch[0] && strlen(s->epoch) == k && memcmp(s->epoch, epoch, k) == 0;
    pthread_mutex_unlock(&s->lock);
    hmac_t h;
    hmac_start(&h, grant_key);
    hmac_part(&h, "read", 4);
    hmac_part(&h, s->segment_id, (uint32_t)strlen(s->segment_id));
    hmac_part(&h, epoch, k);
    hmac_part(&h, &expires_at, 8);
    hmac_part(&h, granted, m * 16);
    hmac_finish(&h, expected);
    if (!equal_ct(mac, expected, 32)) {
        say(why, MSG, "read refused: the grant is not the master's, or not for this segment");
        return -1;
    }
    if (!same_epoch) {
        say(why, MSG, "refused: the grant comes from another run of the master than this segment knows");
        return -1;
    }
    double now_s = (double)now_ns(CLOCK_REALTIME) / 1e9;
    if (now_s > expires_at) {
        say(why, MSG, "refused: the grant expired %.1f s ago", now_s - expires_at);
        return -1;
    }
    int exact = m == n && memcmp(requested, granted, (size_t)n * 16) == 0;
    *total = 0;
    for (uint32_t i = 0; i < n; i++) {
        int64_t row[2];
        memcpy(row, requested + 16 * (size_t)i, 16);
        if (!exact) {
            const int64_t *hit = bsearch(row, granted, m, 16, range_cmp);
            if (!hit || hit[1] != row[1]) {
                say(why, MSG, "read refused: range %u (%lld, %lld) is not granted", i, (long long)row[0],
                    (long long)row[1]);
                return -1;
            }
        }
        if (row[0] < 0 || row[1] < 0 || (uint64_t)row[0] > s->capacity || (uint64_t)row[1] > s->capacity - row[0]) {
            say(why, MSG, "range %u [offset %lld, length %lld] ends beyond the %llu-byte segment", i,
                (long long)row[0], (long long)row[1], (unsigned long long)s->capacity);
            return -1;
        }
        *total += (uint64_t)row[1];
    }
    *ranges = (const int64_t *)requested; /* unaligned reads are memcpy'd below */
    *count = n;
    return 0;
malformed:
    say(why, MSG, "malformed read request");
    return -1;
}

static ucs_status_t on_read(void *arg, const void *header, size_t header_len, void *data, size_t len,
                            const ucp_am_recv_param_t *param) {
    server_t *s = arg;
    sconn_t *c = find_conn(s, (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : NULL);
    if (!c || c->state != 3 || header_len != 8 + 32 || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV))
        return ignore(s);
    uint8_t tag[32];
    hmac_t h;
    hmac_start(&h, c->session);
    sha256_update(&h.inner, header, 8);
    sha256_update(&h.inner, data, len);
    hmac_finish(&h, tag);
    if (!equal_ct(tag, (const uint8_t *)header + 8, 32)) return ignore(s);
    reply_header_t reply = {0};
    memcpy(&reply.request_id, header, 8);
    char why[MSG];
    const int64_t *ranges;
    uint32_t count;
    if (check_read(s, data, len, &ranges, &count, &reply.bytes, why)) {
        __atomic_add_fetch(&s->refused, 1, __ATOMIC_RELAXED);
        reply.status = READ_REFUSED;
        reply.bytes = 0;
        ucp_dt_iov_t iov = {.buffer = why, .length = strlen(why)};
        post_am(c->ep, AM_READ_REPLY, &reply, sizeof reply, &iov, 1, UCP_AM_SEND_FLAG_EAGER, 1);
        return UCS_OK;
    }
    ucp_dt_iov_t stack[64], *iov = count <= 64 ? stack : malloc(count * sizeof *iov);
    if (!iov) {
        close_soon(c);
        return UCS_OK;
    }
    for (uint32_t i = 0; i < count; i++) {
        int64_t row[2];
        memcpy(row, (const uint8_t *)ranges + 16 * (size_t)i, 16);
        iov[i].buffer = s->segment + row[0];
        iov[i].length = (size_t)row[1];
    }
    if (post_am(c->ep, AM_READ_REPLY, &reply, sizeof reply, iov, count, 0, 0)) close_soon(c); /* zero copy */
    else __atomic_add_fetch(&s->served, 1, __ATOMIC_RELAXED);
    if (iov != stack) free(iov);
    return UCS_OK;
}

static void server_housekeeping(server_t *s) {
    int64_t now = now_ns(CLOCK_MONOTONIC);
    for (int i = 0; i < MAX_CONNS; i++) {
        sconn_t *c = &s->conns[i];
        if ((c->state == 1 || c->state == 2) && now - c->since_ns > HANDSHAKE_NS)
            refuse(c, "authentication refused: no proof of the store secret in time", 1);
        if (c->state == 5 && now - c->since_ns > REFUSED_CLOSE_NS) drop_conn(c);
        if (c->state == 4 && c->closing && ucp_request_check_status(c->closing) != UCS_INPROGRESS) {
            ucp_request_free(c->closing);
            c->closing = NULL;
            c->state = 0;
        }
    }
}

static void *server_main(void *arg) {
    server_t *s = arg;
    int64_t last_busy = now_ns(CLOCK_MONOTONIC), last_house = last_busy;
    while (!s->stop) {
        while (ucp_worker_progress(s->worker)) last_busy = now_ns(CLOCK_MONOTONIC);
        int64_t now = now_ns(CLOCK_MONOTONIC);
        if (now - last_house > 100000000LL) server_housekeeping(s), last_house = now;
        if (now - last_busy < SERVER_SPIN_NS) {
            sched_yield();
            continue;
        }
        ucs_status_t st = ucp_worker_arm(s->worker);
        if (st == UCS_ERR_BUSY) continue;
        struct pollfd fds[2] = {{.fd = s->efd, .events = POLLIN}, {.fd = s->stopfd, .events = POLLIN}};
        poll(fds, 2, 100);
        last_busy = now_ns(CLOCK_MONOTONIC) - SERVER_SPIN_NS + 20000; /* a short spin after a wake-up */
    }
    if (s->listener) ucp_listener_destroy(s->listener), s->listener = NULL;
    for (int i = 0; i < MAX_CONNS; i++) drop_conn(&s->conns[i]);
    int64_t deadline = now_ns(CLOCK_MONOTONIC) + 2000000000LL;
    for (;;) {
        ucp_worker_progress(s->worker);
        server_housekeeping(s);
        int open = 0;
        for (int i = 0; i < MAX_CONNS; i++) open += s->conns[i].state != 0;
        if (!open || now_ns(CLOCK_MONOTONIC) > deadline) break;
    }
    return NULL;
}

static void server_free(server_t *s) {
    if (s->worker) ucp_worker_destroy(s->worker);
    if (s->context) ucp_cleanup(s->context);
    if (s->stopfd >= 0) close(s->stopfd);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

void *rt_server_start(const char *host, int port, void *segment, uint64_t capacity, const char *segment_id,
                      const uint8_t *peer_key, const uint8_t *grant_key, char *err, int err_len) {
    struct sockaddr_storage addr;
    socklen_t addr_len;
    if (strlen(segment_id) >= MAX_EPOCH || strlen(host) >= 64) {
        say(err, err_len, "segment id or host too long");
        return NULL;
    }
    if (make_sockaddr(host, port, &addr, &addr_len)) {
        say(err, err_len, "host %s is not an IP address", host);
        return NULL;
    }
    server_t *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    pthread_mutex_init(&s->lock, NULL);
    s->stopfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    s->segment = segment, s->capacity = capacity;
    strcpy(s->segment_id, segment_id);
    strcpy(s->host, host);
    memcpy(s->peer_key, peer_key, KEY);
    memcpy(s->grant_key, grant_key, KEY);
    /* Made here, progressed by the server thread, destroyed here after it is joined: one at a time. */
    ucs_status_t st = make_worker(&s->context, &s->worker, UCS_THREAD_MODE_SERIALIZED, &s->efd);
    if (st != UCS_OK) {
        say(err, err_len, "UCX worker: %s", ucs_status_string(st));
        s->context = NULL;
        server_free(s);
        return NULL;
    }
    if (set_handler(s->worker, AM_HELLO, on_hello, s) != UCS_OK || set_handler(s->worker, AM_AUTH, on_auth, s) != UCS_OK ||
        set_handler(s->worker, AM_READ, on_read, s) != UCS_OK) {
        say(err, err_len, "UCX: cannot set the active message handlers");
        server_free(s);
        return NULL;
    }
    ucp_listener_params_t lp = {.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
                                .sockaddr = {.addr = (struct sockaddr *)&addr, .addrlen = addr_len},
                                .conn_handler = {.cb = server_conn, .arg = s}};
    st = ucp_listener_create(s->worker, &lp, &s->listener);
    if (st != UCS_OK) {
        say(err, err_len, "UCX listener on %s:%d: %s", host, port, ucs_status_string(st));
        s->listener = NULL;
        server_free(s);
        return NULL;
    }
    ucp_listener_attr_t attr = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
    if (ucp_listener_query(s->listener, &attr) != UCS_OK) {
        say(err, err_len, "UCX: cannot query the listener's port");
        ucp_listener_destroy(s->listener);
        server_free(s);
        return NULL;
    }
    s->port = ntohs(attr.sockaddr.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&attr.sockaddr)->sin6_port
                                                         : ((struct sockaddr_in *)&attr.sockaddr)->sin_port);
    if (pthread_create(&s->thread, NULL, server_main, s)) {
        say(err, err_len, "cannot start the server thread");
        ucp_listener_destroy(s->listener);
        server_free(s);
        return NULL;
    }
    s->started = 1;
    return s;
}

int rt_server_port(void *handle) { return ((server_t *)handle)->port; }

void rt_server_set(void *handle, const char *epoch, const uint8_t *peer_key, const uint8_t *grant_key) {
    server_t *s = handle;
    pthread_mutex_lock(&s->lock);
    snprintf(s->epoch, MAX_EPOCH, "%s", epoch);
    memcpy(s->peer_key, peer_key, KEY);
    memcpy(s->grant_key, grant_key, KEY);
    pthread_mutex_unlock(&s->lock);
}

uint64_t rt_server_stat(void *handle, int which) {
    server_t *s = handle;
    uint64_t values[4] = {s->served, s->refused, s->accepted, s->rejected};
    return which >= 0 && which < 4 ? values[which] : 0;
}

void rt_server_stop(void *handle) {
    server_t *s = handle;
    s->stop = 1;
    uint64_t one = 1;
    if (write(s->stopfd, &one, 8) != 8) { /* the thread still sees stop within its poll's 100 ms */
    }
    if (s->started) pthread_join(s->thread, NULL);
    server_free(s);
}

/* ---- client ------------------------------------------------------------------------------------ */

typedef struct cconn {
    char host[64];
    int port;
    ucp_ep_h ep;
    volatile int failed;
    uint8_t session[KEY]; /* signs this connection's READs */
    struct cconn *next;
} cconn_t;

typedef struct {
    ucp_context_h context;
    ucp_worker_h worker;
    int efd;
    pthread_mutex_t lock; /* one call at a time on the worker */
    uint8_t peer_key[KEY];
    cconn_t *conns;
    cconn_t *current;
    /* the message being waited for */
    int got;                 /* AM id received, 0 while waiting */
    uint8_t header[64];
    size_t header_len;
    char refusal[MSG];
    uint64_t want_id, next_id;
    const ucp_dt_iov_t *dest;
    size_t dest_count;
    uint64_t dest_bytes;
    void *rndv;              /* the reply's data descriptor, to receive outside the callback */
    size_t rndv_len;
    int recv_state;          /* 0 none, 1 receiving, 2 received, 3 failed */
} client_t;

static void client_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep, (void)status;
    ((cconn_t *)arg)->failed = 1;
}

static void copy_message(char *out, const void *data, size_t len) {
    size_t n = len < MSG - 1 ? len : MSG - 1;
    memcpy(out, data, n);
    out[n] = 0;
}

static ucs_status_t on_client_message(client_t *c, unsigned id, const void *header, size_t header_len, void *data,
                                      size_t len, const ucp_am_recv_param_t *param) {
    int rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (id == AM_READ_REPLY) {
        reply_header_t reply;
        if (header_len != sizeof reply) return UCS_OK;
        memcpy(&reply, header, sizeof reply);
        if (reply.request_id != c->want_id || c->got) return UCS_OK; /* a reply to a read given up on */
        c->got = id;
        memcpy(c->header, &reply, sizeof reply);
        c->header_len = sizeof reply;
        if (reply.status != READ_OK) {
            if (rndv) return UCS_OK;
            copy_message(c->refusal, data, len);
            return UCS_OK;
        }
        if (len != c->dest_bytes) {
            snprintf(c->refusal, MSG, "the reply carries %zu bytes for %llu", len, (unsigned long long)c->dest_bytes);
            c->recv_state = 3;
            return UCS_OK;
        }
        if (rndv) {
            c->rndv = data, c->rndv_len = len;
            return UCS_INPROGRESS;
        }
        const uint8_t *p = data;
        for (size_t i = 0; i < c->dest_count; i++) memcpy(c->dest[i].buffer, p, c->dest[i].length), p += c->dest[i].length;
        c->recv_state = 2;
        return UCS_OK;
    }
    if (c->got) return UCS_OK;
    c->got = id;
    c->header_len = header_len < sizeof c->header ? header_len : sizeof c->header;
    memcpy(c->header, header, c->header_len);
    if (id == AM_REFUSED && !rndv) copy_message(c->refusal, data, len);
    return UCS_OK;
}

#define CLIENT_HANDLER(name, id)                                                                                    \
    static ucs_status_t name(void *arg, const void *h, size_t hl, void *d, size_t l, const ucp_am_recv_param_t *p) { \
        return on_client_message(arg, id, h, hl, d, l, p);                                                          \
    }
CLIENT_HANDLER(on_challenge, AM_CHALLENGE)
CLIENT_HANDLER(on_auth_ok, AM_AUTH_OK)
CLIENT_HANDLER(on_refused, AM_REFUSED)
CLIENT_HANDLER(on_read_reply, AM_READ_REPLY)

void *rt_client_new(const uint8_t *peer_key, char *err, int err_len) {
    client_t *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    pthread_mutex_init(&c->lock, NULL);
    memcpy(c->peer_key, peer_key, KEY);
    if (getrandom(&c->next_id, sizeof c->next_id, 0) != sizeof c->next_id) c->next_id = (uint64_t)now_ns(CLOCK_REALTIME);
    ucs_status_t st = make_worker(&c->context, &c->worker, UCS_THREAD_MODE_SERIALIZED, &c->efd);
    if (st == UCS_OK && (set_handler(c->worker, AM_CHALLENGE, on_challenge, c) != UCS_OK ||
                         set_handler(c->worker, AM_AUTH_OK, on_auth_ok, c) != UCS_OK ||
                         set_handler(c->worker, AM_REFUSED, on_refused, c) != UCS_OK ||
                         set_handler(c->worker, AM_READ_REPLY, on_read_reply, c) != UCS_OK))
        st = UCS_ERR_NO_RESOURCE;
    if (st != UCS_OK) {
        say(err, err_len, "UCX worker: %s", ucs_status_string(st));
        if (c->worker) ucp_worker_destroy(c->worker), ucp_cleanup(c->context);
        pthread_mutex_destroy(&c->lock);
        free(c);
        return NULL;
    }
    return c;
}

void rt_client_set_key(void *handle, const uint8_t *peer_key) {
    client_t *c = handle;
    pthread_mutex_lock(&c->lock);
    memcpy(c->peer_key, peer_key, KEY);
    pthread_mutex_unlock(&c->lock);
}

/* Progress until done() or the deadline: spin a while, then sleep on the worker's fd. 0, or -1 on timeout.
 * The deadline is checked after every round, busy or not: a transfer that keeps progressing slowly ends there. */
static int client_wait(client_t *c, int (*done)(client_t *), int64_t deadline) {
    int64_t spin_until = now_ns(CLOCK_MONOTONIC) + CLIENT_SPIN_NS;
    for (;;) {
        if (done(c)) return 0;
        unsigned progressed = ucp_worker_progress(c->worker);
        if (done(c)) return 0;
        int64_t now = now_ns(CLOCK_MONOTONIC);
        if (now > deadline) return -1;
        if (progressed) continue;
        if (now < spin_until) {
            sched_yield();
            continue;
        }
        if (ucp_worker_arm(c->worker) == UCS_ERR_BUSY) continue;
        struct pollfd fd = {.fd = c->efd, .events = POLLIN};
        int64_t wait_ms = (deadline - now) / 1000000 + 1;
        poll(&fd, 1, wait_ms > 10 ? 10 : (int)wait_ms);
    }
}

static int got_message(client_t *c) { return c->got != 0 || c->current->failed; }
static int read_finished(client_t *c) { return c->recv_state >= 2 || c->current->failed; }

static void forget(client_t *c, cconn_t *conn) {
    for (cconn_t **p = &c->conns; *p; p = &(*p)->next)
        if (*p == conn) {
            *p = conn->next;
            break;
        }
    void *r = close_ep(c->worker, conn->ep);
    int64_t deadline = now_ns(CLOCK_MONOTONIC) + 1000000000LL;
    while (r && ucp_request_check_status(r) == UCS_INPROGRESS && now_ns(CLOCK_MONOTONIC) < deadline)
        ucp_worker_progress(c->worker);
    if (r) ucp_request_free(r);
    free(conn);
}

static int expect(client_t *c, unsigned id, size_t header_len, int64_t deadline, char *err, int err_len,
                  const char *step) {
    if (client_wait(c, got_message, deadline)) {
        say(err, err_len, "no %s from the server in time", step);
        return READ_TIMEOUT;
    }
    if (c->current->failed) {
        say(err, err_len, "the connection failed during the %s", step);
        return READ_FAILED;
    }
    if (c->got == AM_REFUSED) {
        say(err, err_len, "%s", c->refusal);
        return READ_FAILED;
    }
    if (c->got != (int)id || c->header_len != header_len) {
        say(err, err_len, "unexpected message during the %s", step);
        return READ_FAILED;
    }
    return READ_OK;
}

static int connect_to(client_t *c, const char *host, int port, int64_t deadline, char *err, int err_len) {
    for (cconn_t *conn = c->conns; conn; conn = conn->next)
        if (conn->port == port && strcmp(conn->host, host) == 0) {
            if (!conn->failed) {
                c->current = conn;
                return READ_OK;
            }
            forget(c, conn);
            break;
        }
    struct sockaddr_storage addr;
    socklen_t addr_len;
    if (strlen(host) >= 64 || make_sockaddr(host, port, &addr, &addr_len)) {
        say(err, err_len, "host %s is not an IP address", host);
        return READ_FAILED;
    }
    cconn_t *conn = calloc(1, sizeof *conn);
    if (!conn) return READ_FAILED;
    strcpy(conn->host, host);
    conn->port = port;
    ucp_ep_params_t p = {.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                                       UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                         .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
                         .sockaddr = {.addr = (struct sockaddr *)&addr, .addrlen = addr_len},
                         .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                         .err_handler = {.cb = client_ep_error, .arg = conn}};
    ucs_status_t st = ucp_ep_create(c->worker, &p, &conn->ep);
    if (st != UCS_OK) {
        say(err, err_len, "cannot connect to %s:%d: %s", host, port, ucs_status_string(st));
        free(conn);
        return READ_FAILED;
    }
    conn->next = c->conns, c->conns = conn, c->current = conn;
    c->got = 0;
    int rc = post_am(conn->ep, AM_HELLO, NULL, 0, NULL, 0, UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER, 0)
                 ? READ_FAILED
                 : expect(c, AM_CHALLENGE, NONCE, deadline, err, err_len, "challenge");
    uint8_t server_nonce[NONCE], auth[NONCE + 32], expected[32];
    if (rc == READ_OK) {
        memcpy(server_nonce, c->header, NONCE);
        if (getrandom(auth, NONCE, 0) != NONCE) rc = READ_FAILED;
        proof(c->peer_key, "client", server_nonce, auth, auth + NONCE);
        c->got = 0;
        if (rc == READ_OK &&
            post_am(conn->ep, AM_AUTH, auth, sizeof auth, NULL, 0, UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER, 0))
            rc = READ_FAILED;
        if (rc == READ_OK) rc = expect(c, AM_AUTH_OK, 32, deadline, err, err_len, "handshake's answer");
    }
    if (rc == READ_OK) {
        proof(c->peer_key, "server", server_nonce, auth, expected);
        if (!equal_ct(expected, c->header, 32)) {
            say(err, err_len, "authentication failed: the server does not hold the store secret");
            rc = READ_FAILED;
        }
        proof(c->peer_key, "session", server_nonce, auth, conn->session);
    }
    if (rc != READ_OK) forget(c, conn);
    if (rc == READ_TIMEOUT) rc = READ_FAILED; /* a server that never answered the handshake: unreachable */
    return rc;
}

static void received_cb(void *request, ucs_status_t status, size_t length, void *user_data) {
    (void)request, (void)length;
    client_t *c = user_data;
    c->recv_state = status == UCS_OK ? 2 : 3;
}

int rt_client_read(void *handle, const char *host, int port, const uint8_t *body, uint64_t body_len, void **buffers,
                   const uint64_t *lengths, int count, double timeout_s, char *err, int err_len) {
    client_t *c = handle;
    if (count <= 0 || count > MAX_RANGES) {
        say(err, err_len, "a read takes 1..%d destinations", MAX_RANGES);
        return READ_FAILED;
    }
    ucp_dt_iov_t stack[64], *iov = count <= 64 ? stack : malloc(count * sizeof *iov);
    if (!iov) return READ_FAILED;
    uint64_t total = 0;
    for (int i = 0; i < count; i++) iov[i].buffer = buffers[i], iov[i].length = lengths[i], total += lengths[i];
    pthread_mutex_lock(&c->lock);
    int64_t deadline = now_ns(CLOCK_MONOTONIC) + (int64_t)(timeout_s * 1e9);
    int rc = connect_to(c, host, port, deadline, err, err_len);
    if (rc != READ_OK) goto out;
    cconn_t *conn = c->current;
    if (++c->next_id == 0) ++c->next_id; /* 0: no read waiting */
    c->got = 0, c->header_len = 0, c->want_id = c->next_id, c->dest = iov, c->dest_count = count, c->dest_bytes = total;
    c->rndv = NULL, c->recv_state = 0, c->refusal[0] = 0;
    ucp_dt_iov_t request = {.buffer = (void *)body, .length = body_len};
    uint8_t header[8 + 32];
    hmac_t h;
    memcpy(header, &c->want_id, 8);
    hmac_start(&h, conn->session);
    sha256_update(&h.inner, header, 8);
    sha256_update(&h.inner, body, body_len);
    hmac_finish(&h, header + 8);
    /* The body is the caller's until this returns; by then its send has completed or been cancelled. */
    if (post_am(conn->ep, AM_READ, header, sizeof header, &request, 1, UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER,
                0)) {
        say(err, err_len, "cannot post the read");
        rc = READ_FAILED;
        forget(c, conn);
        goto out;
    }
    void *receiving = NULL;
    if (client_wait(c, got_message, deadline)) {
        rc = READ_TIMEOUT;
    } else if (conn->failed) {
        rc = READ_FAILED;
        say(err, err_len, "the connection failed during the read");
    } else if (c->got != AM_READ_REPLY) {
        rc = READ_FAILED;
        say(err, err_len, "unexpected message during the read%s%s", c->got == AM_REFUSED ? ": " : "", c->refusal);
    } else {
        reply_header_t reply;
        memcpy(&reply, c->header, sizeof reply);
        if (reply.status != READ_OK) {
            rc = READ_REFUSED;
            say(err, err_len, "%s", c->refusal);
        } else if (c->recv_state == 3) {
            rc = READ_FAILED;
            say(err, err_len, "%s", c->refusal);
        } else if (c->rndv) {
            ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                                                     UCP_OP_ATTR_FIELD_DATATYPE,
                                     .cb.recv_am = received_cb,
                                     .user_data = c,
                                     .datatype = ucp_dt_make_iov()};
            c->recv_state = 1;
            ucs_status_ptr_t r = ucp_am_recv_data_nbx(c->worker, c->rndv, iov, count, &p);
            c->rndv = NULL;
            if (r == NULL) c->recv_state = 2;
            else if (UCS_PTR_IS_ERR(r)) c->recv_state = 3;
            else receiving = r;
        }
        if (rc == READ_OK && client_wait(c, read_finished, deadline)) rc = READ_TIMEOUT;
        else if (rc == READ_OK && c->recv_state != 2) {
            rc = READ_FAILED;
            say(err, err_len, "the connection failed during the read's data");
        }
    }
    if (rc == READ_TIMEOUT) say(err, err_len, "read timed out after %.3g s", timeout_s);
    c->want_id = 0; /* from here on a late reply is a stranger's */
    if (c->rndv) { /* a reply's data never received: give its descriptor back */
        ucp_am_data_release(c->worker, c->rndv);
        c->rndv = NULL;
    }
    if (receiving && ucp_request_check_status(receiving) == UCS_INPROGRESS) ucp_request_cancel(c->worker, receiving);
    if (rc != READ_OK && rc != READ_REFUSED) forget(c, conn); /* before the destination goes back to the caller */
    if (receiving) {
        while (ucp_request_check_status(receiving) == UCS_INPROGRESS) ucp_worker_progress(c->worker);
        ucp_request_free(receiving);
    }
out:
    c->dest = NULL, c->dest_count = 0, c->want_id = 0;
    pthread_mutex_unlock(&c->lock);
    if (iov != stack) free(iov);
    return rc;
}

void rt_client_close(void *handle) {
    client_t *c = handle;
    pthread_mutex_lock(&c->lock);
    while (c->conns) forget(c, c->conns);
    pthread_mutex_unlock(&c->lock);
    ucp_worker_destroy(c->worker);
    ucp_cleanup(c->context);
    pthread_mutex_destroy(&c->lock);
    free(c);
}
