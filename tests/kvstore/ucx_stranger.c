/* A UCX peer that knows no store secret. It connects to a listener and, without saying a word of the store's
 * protocol, asks UCX for a remote read ("get") or write ("put") of an address in the listening process; or
 * ("am") sends a native reader (kvstore/ucx_native.c) a READ active message for LENGTH bytes at offset ADDRESS
 * of its segment, with a grant signed by nobody, without the handshake.
 *
 *   ucx_stranger get|put|am HOST PORT ADDRESS LENGTH
 *
 * Prints "READ <hex>" (get, or am answered with data), "PUT COMPLETED" (put) when UCX completed the
 * operation, "REFUSED <message>" (am refused), else "FAILED <reason>" with a non-zero exit. A completed put only says UCX sent it: whether the target wrote is seen in its memory. The rkey is one of the stranger's own memory: where no transport does RMA in hardware, UCX
 * emulates it with active messages that carry the bare address, so no key of the target is needed.
 * Used by tests/kvstore/test_ucx_features.py. */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucp/api/ucp.h>

static double now_s(void);

static char am_answer[8192]; /* what the native reader sent back: "REFUSED ..." or "READ <hex>" */

static ucs_status_t on_answer(void *arg, const void *header, size_t header_length, void *data, size_t length,
                              const ucp_am_recv_param_t *param) {
    (void)header, (void)header_length, (void)param;
    size_t n = length < 1024 ? length : 1024;
    if ((uintptr_t)arg == 13) {
        snprintf(am_answer, sizeof(am_answer), "REFUSED %.*s", (int)n, (const char *)data);
    } else if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        char *out = am_answer + snprintf(am_answer, sizeof(am_answer), "READ ");
        for (size_t i = 0; i < n; i++) out += sprintf(out, "%02x", ((const unsigned char *)data)[i]);
    } else {
        snprintf(am_answer, sizeof(am_answer), "READ (rendezvous)");
    }
    return UCS_OK;
}

/* The native reader's READ: one range, granted by an all-zero signature, epoch "", for a minute. */
static int send_read(ucp_worker_h worker, ucp_ep_h ep, uint64_t offset, uint64_t length) {
    unsigned char body[4 + 16 + 4 + 16 + 8 + 4 + 32] = {0}, *p = body;
    uint32_t one = 1;
    int64_t range[2] = {(int64_t)offset, (int64_t)length};
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    double expires = (double)t.tv_sec + 60.0;
    memcpy(p, &one, 4), p += 4, memcpy(p, range, 16), p += 16, memcpy(p, &one, 4), p += 4, memcpy(p, range, 16);
    p += 16, memcpy(p, &expires, 8);
    for (uintptr_t id = 13; id <= 14; id++) {
        ucp_am_handler_param_t handler = {0};
        handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                             UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
        handler.id = (unsigned)id, handler.cb = on_answer, handler.arg = (void *)id;
        handler.flags = UCP_AM_FLAG_WHOLE_MSG;
        if (ucp_worker_set_am_recv_handler(worker, &handler) != UCS_OK) return 1;
    }
    uint64_t request_id = 1;
    ucp_request_param_t params = {0};
    params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    params.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t request = ucp_am_send_nbx(ep, 3, &request_id, sizeof(request_id), body, sizeof(body), &params);
    if (UCS_PTR_IS_ERR(request)) {
        printf("FAILED am: %s\n", ucs_status_string(UCS_PTR_STATUS(request)));
        return 1;
    }
    double deadline = now_s() + 3.0;
    while (!am_answer[0] && now_s() < deadline) ucp_worker_progress(worker);
    if (!am_answer[0]) {
        printf("FAILED am: no answer\n");
        return 1;
    }
    printf("%s\n", am_answer);
    return 0;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int fail(const char *what, ucs_status_t status) {
    printf("FAILED %s: %s\n", what, ucs_status_string(status));
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 6 || (strcmp(argv[1], "get") != 0 && strcmp(argv[1], "put") != 0 && strcmp(argv[1], "am") != 0)) {
        fprintf(stderr, "usage: %s get|put|am HOST PORT ADDRESS LENGTH\n", argv[0]);
        return 2;
    }
    const int is_get = strcmp(argv[1], "get") == 0;
    const uint64_t remote = strtoull(argv[4], NULL, 0);
    const size_t length = strtoull(argv[5], NULL, 0);
    struct sockaddr_in server = {0};
    server.sin_family = AF_INET;
    server.sin_port = htons((uint16_t)atoi(argv[3]));
    if (length == 0 || length > 4096 || inet_pton(AF_INET, argv[2], &server.sin_addr) != 1) {
        fprintf(stderr, "bad host or length\n");
        return 2;
    }

    ucp_config_t *config;
    ucp_context_h context;
    ucp_worker_h worker;
    ucp_ep_h ep;
    ucs_status_t status;
    ucp_params_t params = {0};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_TAG | UCP_FEATURE_STREAM | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    if ((status = ucp_config_read(NULL, NULL, &config)) != UCS_OK) return fail("config", status);
    status = ucp_init(&params, config, &context);
    ucp_config_release(config);
    if (status != UCS_OK) return fail("init", status);
    ucp_worker_params_t worker_params = {0};
    worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
    if ((status = ucp_worker_create(context, &worker_params, &worker)) != UCS_OK) return fail("worker", status);

    ucp_ep_params_t ep_params = {0};
    ep_params.field_mask =
        UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep_params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep_params.sockaddr.addr = (struct sockaddr *)&server;
    ep_params.sockaddr.addrlen = sizeof(server);
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    if ((status = ucp_ep_create(worker, &ep_params, &ep)) != UCS_OK) return fail("connect", status);

    if (strcmp(argv[1], "am") == 0) return send_read(worker, ep, remote, length);

    static char local[4096];
    ucp_mem_map_params_t map_params = {0};
    map_params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    map_params.address = local;
    map_params.length = sizeof(local);
    ucp_mem_h memh;
    void *rkey_buffer;
    size_t rkey_size;
    ucp_rkey_h rkey;
    if ((status = ucp_mem_map(context, &map_params, &memh)) != UCS_OK) return fail("mem_map", status);
    if ((status = ucp_rkey_pack(context, memh, &rkey_buffer, &rkey_size)) != UCS_OK) return fail("rkey", status);
    double deadline = now_s() + 1.0; /* let the connection's wire-up finish */
    while (now_s() < deadline) ucp_worker_progress(worker);
    if ((status = ucp_ep_rkey_unpack(ep, rkey_buffer, &rkey)) != UCS_OK) return fail("rkey unpack", status);

    char *data = calloc(1, length);
    if (!is_get) memset(data, 'X', length);
    ucp_request_param_t request_params = {0};
    ucs_status_ptr_t request = is_get ? ucp_get_nbx(ep, data, length, remote, rkey, &request_params)
                                      : ucp_put_nbx(ep, data, length, remote, rkey, &request_params);
    if (UCS_PTR_IS_ERR(request)) return fail(argv[1], UCS_PTR_STATUS(request));
    if (!is_get) { /* a put completes locally once sent: a flush waits for the target to have it */
        if (request != NULL) {
            while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS) ucp_worker_progress(worker);
            ucp_request_free(request);
        }
        request = ucp_ep_flush_nbx(ep, &request_params);
        if (UCS_PTR_IS_ERR(request)) return fail("flush", UCS_PTR_STATUS(request));
    }
    if (request != NULL) {
        deadline = now_s() + 3.0;
        while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS && now_s() < deadline)
            ucp_worker_progress(worker);
        if (status != UCS_OK) return fail(is_get ? "get" : "put", status);
        ucp_request_free(request);
    }
    if (is_get) {
        printf("READ ");
        for (size_t i = 0; i < length; i++) printf("%02x", (unsigned char)data[i]);
        printf("\n");
    } else {
        printf("PUT COMPLETED\n");
    }
    return 0;
}
