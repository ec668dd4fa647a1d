/* pdserve: the command-line entry point. Dispatches to a subcommand. */
#include <stdio.h>
#include <string.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "server/commands.h"

static void usage(FILE *out) {
    fprintf(out,
            "pdserve: a small OPT inference server\n\n"
            "usage: pdserve COMMAND [MODEL] [options]\n\n"
            "commands:\n"
            "  make-model DIR --preset P   write a random-weight OPT model (tiny, tiny-postln,\n"
            "                              opt-125m, opt-350m, opt-1.3b) in Hugging Face layout\n"
            "  generate [MODEL] --prompt T offline generation (completion on stdout, timings\n"
            "                              on stderr)\n"
            "  tokenize [MODEL]            text on stdin -> token ids (JSON array) on stdout\n"
            "  detokenize [MODEL]          token ids (JSON array) on stdin -> text on stdout\n"
            "  bench-cpu [MODEL]           memory bandwidth, FLOP rate, prefill and decode speed\n"
            "  bench-throughput [MODEL]    offline engine throughput: N random prompts at once,\n"
            "                              requests/s and tokens/s (as vLLM's throughput bench)\n"
            "  bench-kv                    KV transfer speed per transport against the link\n"
            "  score [MODEL] --input F     logits and greedy tokens for given token ids (compare\n"
            "                              with another implementation: scripts/compare-hf.py)\n"
            "  serve [MODEL] [flags]       OpenAI-compatible HTTP server (flags as vllm serve)\n\n"
            "MODEL is a Hugging Face model directory or a hub name (org/name) found in the\n"
            "local Hugging Face cache; without it the built-in default model is used.\n"
            "`pdserve COMMAND --help` lists a command's options.\n");
}

/* KV received over the tcp data plane arrives as ZMQ frames of megabytes
 * (one per layer), which libzmq mallocs on its I/O thread and the engine
 * frees once the KV is in the cache. Under glibc's defaults such a buffer
 * is a fresh mmap, or heap pages handed back to the kernel when freed, so
 * every layer of every request is faulted in and zeroed again: bench-kv
 * moved host KV at about half the speed it reaches with the pages kept.
 * So blocks up to 32 MiB (the most glibc accepts here) come from the heap,
 * and up to 256 MiB of freed heap stays mapped for the next request. This
 * is a policy for the whole process, hence set by the program, not by the
 * connector library. */
static void keep_freed_buffers_mapped(void) {
#ifdef __GLIBC__
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 256 << 20);
#endif
}

int main(int argc, char **argv) {
    keep_freed_buffers_mapped();
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "make-model")) return cmd_make_model(argc - 2, argv + 2);
    if (!strcmp(cmd, "generate")) return cmd_generate(argc - 2, argv + 2);
    if (!strcmp(cmd, "tokenize")) return cmd_tokenize(argc - 2, argv + 2);
    if (!strcmp(cmd, "detokenize")) return cmd_detokenize(argc - 2, argv + 2);
    if (!strcmp(cmd, "bench-cpu")) return cmd_bench_cpu(argc - 2, argv + 2);
    if (!strcmp(cmd, "bench-kv")) return cmd_bench_kv(argc - 2, argv + 2);
    if (!strcmp(cmd, "bench-throughput")) return cmd_bench_throughput(argc - 2, argv + 2);
    if (!strcmp(cmd, "score")) return cmd_score(argc - 2, argv + 2);
    if (!strcmp(cmd, "serve")) return cmd_serve(argc - 2, argv + 2);
    fprintf(stderr, "pdserve: unknown command '%s' (try pdserve --help)\n", cmd);
    return 2;
}
