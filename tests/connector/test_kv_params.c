/* test_kv_params: --kv-transfer-config and kv_transfer_params parsing —
 * vLLM's spellings (numbers given as strings), defaults, and a clear error
 * naming the key for every bad value. */
#include <string.h>

#include "connector/connector.h"
#include "tests/common/testlib.h"

static void config_ok(void) {
    kv_transfer_config c;
    pd_err err = {{0}};
    /* The vLLM example launch line, verbatim in shape. */
    const char *vllm = "{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_producer\",\"kv_buffer_size\":\"1e1\","
                       "\"kv_port\":\"21001\",\"kv_connector_extra_config\":{\"proxy_ip\":\"0.0.0.0\",\"proxy_port\":"
                       "\"30001\",\"http_port\":\"20003\",\"send_type\":\"PUT_ASYNC\",\"nccl_num_channels\":\"16\"}}";
    CHECKF(kv_transfer_config_parse(vllm, &c, &err) == 0, "%s", err.msg);
    CHECK(c.role == KV_ROLE_PRODUCER && c.kv_port == 21001 && c.kv_buffer_size == 10);
    CHECK(!strcmp(c.proxy_ip, "0.0.0.0") && c.proxy_port == 30001 && c.http_port == 20003);
    CHECK(c.send_type == KV_SEND_PUT_ASYNC && c.nccl_num_channels == 16);
    /* Defaults of protocol.md. */
    CHECK(kv_transfer_config_parse("{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_consumer\"}", &c, &err) == 0);
    CHECK(c.role == KV_ROLE_CONSUMER && c.kv_port == 14579 && c.kv_buffer_size == 1e9 && c.send_type == KV_SEND_PUT_ASYNC);
    CHECK(c.transport == KV_TRANSPORT_TCP && c.timeout_s == 30 && c.proxy_ip[0] == 0 &&
          !c.recv_into_pinned && !c.recompute_on_load_failure);
    /* proxy_ip without proxy_port: as vLLM, it starts and announces to no one (a warning). */
    CHECK(kv_transfer_config_parse("{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\","
                                   "\"kv_connector_extra_config\":{\"proxy_ip\":\"1.2.3.4\"}}",
                                   &c, &err) == 0 &&
          c.proxy_ip[0] == 0);
    /* A key given twice: its last value, as Python's json reads it. */
    CHECK(kv_transfer_config_parse(
              "{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_producer\","
              "\"kv_role\":\"kv_consumer\",\"kv_port\":1,\"kv_port\":2}",
              &c, &err) == 0 &&
          c.role == KV_ROLE_CONSUMER && c.kv_port == 2);
    /* vLLM's kv_load_failure_policy, a top-level key. */
    CHECK(kv_transfer_config_parse(
              "{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_consumer\","
              "\"kv_load_failure_policy\":\"recompute\"}",
              &c, &err) == 0 &&
          c.recompute_on_load_failure);
    CHECK(kv_transfer_config_parse(
              "{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_consumer\","
              "\"kv_load_failure_policy\":\"fail\"}",
              &c, &err) == 0 &&
          !c.recompute_on_load_failure);
    CHECK(kv_transfer_config_parse(
              "{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_consumer\","
              "\"kv_connector_extra_config\":{\"recv_into_pinned\":true}}",
              &c, &err) == 0 &&
          c.recv_into_pinned && c.mem_pool_size_gb == 1 && c.tcp_streams == 1);
    CHECK(kv_transfer_config_parse(
              "{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_consumer\","
              "\"kv_connector_extra_config\":{\"tcp_streams\":4}}",
              &c, &err) == 0 &&
          c.tcp_streams == 4);
    CHECK(kv_transfer_config_parse(
              "{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_consumer\","
              "\"kv_connector_extra_config\":{\"mem_pool_size_gb\":\"32\"}}",
              &c, &err) == 0 &&
          c.mem_pool_size_gb == 32);
    CHECK(kv_transfer_config_parse("{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_buffer_size\":5e9,"
                                   "\"kv_connector_extra_config\":{\"send_type\":\"GET\",\"transport\":\"nccl\","
                                   "\"timeout_s\":2.5},\"kv_rank\":0,\"future_key\":1}",
                                   &c, &err) == 0);
    CHECK(c.role == KV_ROLE_BOTH && c.kv_buffer_size == 5e9 && c.send_type == KV_SEND_GET);
    CHECK(c.transport == KV_TRANSPORT_NCCL && c.timeout_s == 2.5);
}

static void config_bad(void) {
    struct {
        const char *json, *expect;
    } cases[] = {
        {"[]", "JSON object"},
        {"{\"kv_role\":\"kv_producer\"}", "kv_connector"},
        {"{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_producer\"}", "NixlConnector"},
        {"{\"kv_connector\":\"P2pNcclConnector\"}", "kv_role"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"prefill\"}", "kv_role"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_port\":0}",
         "kv_port"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_port\":\"abc\"}",
         "kv_port"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_buffer_size\":-1}",
         "kv_buffer_size"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_ip\":5}", "kv_ip"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_"
         "config\":3}",
         "kv_connector_extra_config"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_"
         "config\":{\"send_type\":\"PUSH\"}}",
         "send_type"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_"
         "config\":{\"transport\":\"rdma\"}}",
         "transport"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_"
         "config\":{\"proxy_port\":\"x\"}}",
         "proxy_port"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_"
         "config\":{\"timeout_s\":0}}",
         "timeout_s"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_"
         "config\":{\"nccl_num_channels\":\"1.5\"}}",
         "nccl_num_channels"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_"
         "config\":{\"recv_into_pinned\":\"yes\"}}",
         "recv_into_pinned"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_"
         "config\":{\"mem_pool_size_gb\":0}}",
         "mem_pool_size_gb"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_"
         "config\":{\"tcp_streams\":0}}",
         "tcp_streams must be 1..16, got 0"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_"
         "config\":{\"tcp_streams\":2.5}}",
         "tcp_streams"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_"
         "config\":{\"tcp_streams\":17}}",
         "tcp_streams"},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_load_failure_"
         "policy\":\"retry\"}",
         "kv_load_failure_policy must be \"fail\" or \"recompute\", got \"retry\""},
        {"{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_both\",\"kv_load_failure_"
         "policy\":1}",
         "kv_load_failure_policy"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kv_transfer_config c;
        pd_err err = {{0}};
        int rc = kv_transfer_config_parse(cases[i].json, &c, &err);
        CHECKF(rc != 0 && strstr(err.msg, cases[i].expect), "%s -> rc %d, '%s' (wanted '%s')", cases[i].json, rc,
               err.msg, cases[i].expect);
    }
}

static void request_params(void) {
    kv_request_params p;
    pd_err err = {{0}};
    CHECK(kv_request_params_parse(NULL, &p, &err) == 0 && !p.present);
    CHECK(kv_request_params_parse("null", &p, &err) == 0 && !p.present);
    /* A vLLM-design proxy sends only remote_kv_addr to the prefill. */
    CHECK(kv_request_params_parse("{\"remote_kv_addr\":\"10.0.0.2:22001\"}", &p, &err) == 0);
    CHECK(p.present && p.do_remote_decode && !p.do_remote_prefill && !strcmp(p.remote_kv_addr, "10.0.0.2:22001"));
    /* What a prefill returns, handed to the decode unchanged. */
    CHECK(kv_request_params_parse("{\"do_remote_prefill\":true,\"do_remote_decode\":false,\"remote_kv_addr\":\"h-1:1\","
                                  "\"remote_request_id\":\"xfer-ab-1\",\"num_tokens\":17}",
                                  &p, &err) == 0);
    CHECK(p.do_remote_prefill && !p.do_remote_decode && p.num_tokens == 17 && !strcmp(p.remote_request_id, "xfer-ab-1"));
    /* NIXL-style nulls and extras are fine. */
    CHECK(kv_request_params_parse("{\"do_remote_decode\":true,\"remote_engine_id\":null,\"remote_block_ids\":null,"
                                  "\"remote_kv_addr\":null}",
                                  &p, &err) == 0);
    CHECK(p.present && !p.remote_kv_addr[0]);
    const char *bad[] = {
        "\"str\"", "[1]", "{\"remote_kv_addr\":5}", "{\"remote_kv_addr\":\"nohost\"}",
        "{\"remote_kv_addr\":\"h:0\"}", "{\"remote_kv_addr\":\"h:70000\"}",
        "{\"remote_kv_addr\":\"bad host:1\"}", "{\"remote_request_id\":\"x\"}",
        "{\"remote_request_id\":\"\",\"remote_kv_addr\":\"h:1\"}",
        "{\"remote_request_id\":\"a#1\",\"remote_kv_addr\":\"h:1\"}", "{\"do_remote_decode\":1}",
        "{\"num_tokens\":1.5,\"remote_kv_addr\":\"h:1\"}", "{bad json",
        /* a decode request without the prefill's transfer id */
        "{\"do_remote_prefill\":true,\"remote_kv_addr\":\"h:1\"}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = kv_request_params_parse(bad[i], &p, &err);
        CHECKF(rc != 0 && strstr(err.msg, "kv_transfer_params"), "%s -> rc %d '%s'", bad[i], rc, err.msg);
        CHECK(!p.present);
    }
    kv_save_result r = {"127.0.0.1:5000", "xfer-1-2", 9};
    char buf[512];
    kv_save_result_json(&r, buf, sizeof buf);
    CHECK(kv_request_params_parse(buf, &p, &err) == 0 && p.do_remote_prefill && p.num_tokens == 9 &&
          !strcmp(p.remote_kv_addr, "127.0.0.1:5000") && !strcmp(p.remote_request_id, "xfer-1-2"));
}

int main(void) {
    config_ok();
    config_bad();
    request_params();
    return test_finish();
}
