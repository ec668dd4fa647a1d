/* test_sampler: the sampler against a reference written the way vLLM states
 * it (full sort, ascending cumulative sum for top_p, masks), in double.
 *
 * Empirical checks draw N = 20000 tokens per case. A token with probability p
 * appears with frequency f whose standard deviation is sqrt(p(1-p)/N)
 * (<= 0.0036); each token must lie within 5 of those deviations (false alarm
 * about 6e-7 per token, and the seeds are fixed so a pass is repeatable),
 * and a token the reference filters out must never appear. A check that the
 * bound rejects a neighbouring temperature shows it has the power to fail. */
#include "model/sampler.h"
#include "tests/common/testlib.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NDRAWS 20000

/* ---- reference ---- */

typedef struct ref_hist {
    const int32_t *prompt;
    int n_prompt;
    const int32_t *out;
    int n_out;
} ref_hist;

static int count_in(const int32_t *ids, int n, int id) {
    int c = 0;
    for (int i = 0; i < n; i++)
        c += ids[i] == id;
    return c;
}

/* The logits after penalties, straight from the formulas. */
static void ref_penalise(const sampling_params *p, const ref_hist *h, const float *in, double *l,
                         int V) {
    for (int t = 0; t < V; t++) {
        double x = in[t];
        int c_out = h ? count_in(h->out, h->n_out, t) : 0;
        int c_prompt = h ? count_in(h->prompt, h->n_prompt, t) : 0;
        if (c_out + c_prompt > 0) x = x > 0 ? x / p->repetition_penalty : x * p->repetition_penalty;
        x -= p->frequency_penalty * c_out + p->presence_penalty * (c_out > 0);
        l[t] = x;
    }
}

static const double *g_sort_key;
static int by_key_desc(const void *a, const void *b) {
    int i = *(const int *)a, j = *(const int *)b;
    if (g_sort_key[i] != g_sort_key[j]) return g_sort_key[i] > g_sort_key[j] ? -1 : 1;
    return i - j;
}

/* Final distribution over V tokens, in vLLM V1's order. */
static void ref_probs(const sampling_params *p, const ref_hist *h, const float *logits, int V,
                      double *out) {
    double *l = malloc(V * sizeof *l);
    int *order = malloc(V * sizeof *order);
    bool *keep = malloc(V * sizeof *keep);
    ref_penalise(p, h, logits, l, V);
    if (p->temperature < 1e-5) {
        int best = 0;
        for (int t = 1; t < V; t++)
            if (l[t] > l[best]) best = t;
        for (int t = 0; t < V; t++)
            out[t] = t == best;
        goto done;
    }
    double mx = -INFINITY;
    for (int t = 0; t < V; t++) {
        l[t] /= p->temperature;
        if (l[t] > mx) mx = l[t];
    }
    double z = 0;
    for (int t = 0; t < V; t++)
        z += exp(l[t] - mx);
    /* min_p on the full softmax */
    for (int t = 0; t < V; t++)
        keep[t] = exp(l[t] - mx) / z >= p->min_p * (1.0 / z);
    g_sort_key = l;
    for (int t = 0; t < V; t++)
        order[t] = t;
    qsort(order, V, sizeof *order, by_key_desc);
    if (p->top_k >= 1 && p->top_k < V) {
        /* ties with the k-th largest are kept */
        double kth = l[order[p->top_k - 1]];
        for (int t = 0; t < V; t++)
            if (l[t] < kth) keep[t] = false;
    }
    if (p->top_p < 1) {
        double zk = 0;
        for (int t = 0; t < V; t++)
            if (keep[t]) zk += exp(l[t] - mx);
        /* ascending cumulative sum; drop while cum <= 1 - top_p; never the last */
        double cum = 0;
        for (int r = V - 1; r >= 0; r--) {
            int t = order[r];
            if (!keep[t]) continue;
            cum += exp(l[t] - mx) / zk;
            if (cum <= 1 - p->top_p && r != 0) keep[t] = false;
        }
    }
    double zf = 0;
    for (int t = 0; t < V; t++)
        if (keep[t]) zf += exp(l[t] - mx);
    for (int t = 0; t < V; t++)
        out[t] = keep[t] ? exp(l[t] - mx) / zf : 0;
done:
    free(l);
    free(order);
    free(keep);
}

/* ---- helpers ---- */

static uint64_t lcg_state = 12345;
static double test_uniform(void) {
    lcg_state = lcg_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(lcg_state >> 11) * 0x1.0p-53;
}
static float test_normal(void) {
    double u1 = test_uniform() + 1e-12, u2 = test_uniform();
    return (float)(sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2));
}

static sampling_params params_seeded(uint64_t seed) {
    sampling_params p;
    sampling_params_default(&p);
    p.has_seed = true;
    p.seed = seed;
    return p;
}

/* Draw NDRAWS tokens with fresh copies of the logits; counts[V]. */
static void draw_counts(const sampling_params *p, const float *logits, int V, int *counts) {
    sampler *s = sampler_create(p, V, 0);
    float *buf = malloc(V * sizeof *buf);
    memset(counts, 0, V * sizeof *counts);
    for (int i = 0; i < NDRAWS; i++) {
        memcpy(buf, logits, V * sizeof *buf);
        int32_t t = sampler_sample(s, buf);
        if (t >= 0 && t < V) counts[t]++;
    }
    free(buf);
    sampler_free(s);
}

/* Whether the counts are consistent with expected (see the file comment). */
static bool counts_match(const int *counts, const double *expected, int V, bool verbose) {
    bool ok = true;
    for (int t = 0; t < V; t++) {
        double f = (double)counts[t] / NDRAWS, p = expected[t];
        bool good = p == 0 ? counts[t] == 0 : fabs(f - p) <= 5 * sqrt(p * (1 - p) / NDRAWS);
        if (!good && verbose) fprintf(stderr, "  token %d: freq %.5f expected %.5f\n", t, f, p);
        ok = ok && good;
    }
    return ok;
}

static const float small_logits[10] = {1.0f, 2.0f, 0.5f,  -1.0f, 3.0f,
                                       2.5f, 0.0f, -2.0f, 1.5f,  2.2f};

/* ---- tests ---- */

static void test_validate(void) {
    struct {
        const char *field, *value;
    } bad[] = {
        {"temperature", "-0.5"},
        {"top_p", "0"},
        {"top_p", "1.5"},
        {"top_k", "-2"},
        {"min_p", "-0.1"},
        {"min_p", "1.1"},
        {"presence_penalty", "2.5"},
        {"frequency_penalty", "-3"},
        {"repetition_penalty", "0"},
        {"repetition_penalty", "-1"},
        {"temperature", "nan"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        sampling_params p;
        sampling_params_default(&p);
        double v = strcmp(bad[i].value, "nan") == 0 ? NAN : atof(bad[i].value);
        const char *f = bad[i].field;
        if (!strcmp(f, "temperature")) p.temperature = (float)v;
        if (!strcmp(f, "top_p")) p.top_p = (float)v;
        if (!strcmp(f, "top_k")) p.top_k = (int)v;
        if (!strcmp(f, "min_p")) p.min_p = (float)v;
        if (!strcmp(f, "presence_penalty")) p.presence_penalty = (float)v;
        if (!strcmp(f, "frequency_penalty")) p.frequency_penalty = (float)v;
        if (!strcmp(f, "repetition_penalty")) p.repetition_penalty = (float)v;
        pd_err err = {{0}};
        int rc = sampling_params_validate(&p, &err);
        CHECKF(rc == -1, "%s=%s accepted", f, bad[i].value);
        CHECKF(strstr(err.msg, f) && strstr(err.msg, bad[i].value), "message '%s' for %s=%s",
               err.msg, f, bad[i].value);
        CHECK(sampler_create(&p, 10, 0) == NULL);
    }
    /* the edges of every range are allowed */
    sampling_params p;
    sampling_params_default(&p);
    CHECK(sampling_params_validate(&p, NULL) == 0);
    p.temperature = 0;
    p.top_p = 1;
    p.top_k = -1;
    p.min_p = 1;
    p.presence_penalty = -2;
    p.frequency_penalty = 2;
    p.repetition_penalty = 0.01f;
    CHECK(sampling_params_validate(&p, NULL) == 0);
    p.top_k = 0;
    p.min_p = 0;
    p.presence_penalty = 2;
    p.frequency_penalty = -2;
    CHECK(sampling_params_validate(&p, NULL) == 0);
    p.top_k = 1;
    CHECK(sampling_params_validate(&p, NULL) == 0);
}

static void test_greedy(void) {
    sampling_params p = params_seeded(1);
    p.temperature = 0;
    float l[6] = {0.1f, 3.0f, -1.0f, 3.0f, 2.9f, 3.0f};
    sampler *s = sampler_create(&p, 6, 0);
    CHECK(sampler_sample(s, l) == 1); /* tie between 1, 3, 5: lowest id */
    sampler_free(s);

    /* temperature just under vLLM's 1e-5 is greedy too; top_k=1 and a tiny
     * top_p reduce to greedy on logits without ties */
    enum { V = 1000 };
    static float base[V], buf[V];
    int mismatches[3] = {0, 0, 0};
    for (int trial = 0; trial < 50; trial++) {
        int best = 0;
        for (int i = 0; i < V; i++) {
            base[i] = 3 * test_normal();
            if (base[i] > base[best]) best = i;
        }
        sampling_params cases[3];
        cases[0] = params_seeded(trial);
        cases[0].temperature = 9e-6f;
        cases[1] = params_seeded(trial);
        cases[1].top_k = 1;
        cases[2] = params_seeded(trial);
        cases[2].top_p = 1e-6f;
        for (int c = 0; c < 3; c++) {
            sampler *g = sampler_create(&cases[c], V, 0);
            for (int rep = 0; rep < 20; rep++) {
                memcpy(buf, base, sizeof buf);
                mismatches[c] += sampler_sample(g, buf) != best;
            }
            sampler_free(g);
        }
    }
    CHECKF(mismatches[0] == 0, "temperature 9e-6: %d", mismatches[0]);
    CHECKF(mismatches[1] == 0, "top_k 1: %d", mismatches[1]);
    CHECKF(mismatches[2] == 0, "top_p 1e-6: %d", mismatches[2]);
}

static void run_seq(const sampling_params *p, uint64_t fallback, const float *base, int V, int n,
                    int32_t *out, sampler *interleave) {
    sampler *s = sampler_create(p, V, fallback);
    float *buf = malloc(V * sizeof *buf);
    for (int i = 0; i < n; i++) {
        if (interleave) {
            memcpy(buf, base, V * sizeof *buf);
            sampler_sample(interleave, buf);
        }
        memcpy(buf, base, V * sizeof *buf);
        out[i] = sampler_sample(s, buf);
    }
    free(buf);
    sampler_free(s);
}

static void test_seeds(void) {
    enum { V = 50, N = 200 };
    float base[V];
    for (int i = 0; i < V; i++)
        base[i] = test_normal();
    int32_t a[N], b[N], c[N], d[N];
    sampling_params p = params_seeded(42);
    run_seq(&p, 0, base, V, N, a, NULL);
    run_seq(&p, 999, base, V, N, b, NULL); /* the request seed wins over the fallback */
    CHECK(memcmp(a, b, sizeof a) == 0);
    /* another request sampling in between does not disturb this one */
    sampling_params other = params_seeded(7);
    sampler *o = sampler_create(&other, V, 0);
    run_seq(&p, 0, base, V, N, c, o);
    sampler_free(o);
    CHECK(memcmp(a, c, sizeof a) == 0);
    p.seed = 43;
    run_seq(&p, 0, base, V, N, d, NULL);
    CHECK(memcmp(a, d, sizeof a) != 0);
    /* without a seed the fallback decides */
    p.has_seed = false;
    run_seq(&p, 5, base, V, N, a, NULL);
    run_seq(&p, 5, base, V, N, b, NULL);
    run_seq(&p, 6, base, V, N, c, NULL);
    CHECK(memcmp(a, b, sizeof a) == 0);
    CHECK(memcmp(a, c, sizeof a) != 0);
}

static void test_distributions(void) {
    enum { V = 10 };
    struct {
        const char *name;
        float temperature, top_p, min_p;
        int top_k;
    } cases[] = {
        {"plain", 1.0f, 1.0f, 0.0f, 0},
        {"temperature 0.7", 0.7f, 1.0f, 0.0f, 0},
        {"temperature 1.8", 1.8f, 1.0f, 0.0f, -1},
        {"top_k 3", 1.0f, 1.0f, 0.0f, 3},
        {"top_p 0.8", 1.0f, 0.8f, 0.0f, 0},
        {"min_p 0.2", 1.0f, 1.0f, 0.2f, 0},
        {"all at once", 1.3f, 0.9f, 0.05f, 6},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        sampling_params p = params_seeded(100 + c);
        p.temperature = cases[c].temperature;
        p.top_p = cases[c].top_p;
        p.min_p = cases[c].min_p;
        p.top_k = cases[c].top_k;
        double expected[V];
        int counts[V];
        ref_probs(&p, NULL, small_logits, V, expected);
        draw_counts(&p, small_logits, V, counts);
        bool ok = counts_match(counts, expected, V, true);
        CHECKF(ok, "empirical distribution for %s", cases[c].name);
    }
    /* vLLM V1 applies min_p before top_p, and here the order matters: with
     * probs .5 .2 .1 .1 .05 .05, min_p 0.15 drops the two .05s, and top_p
     * 0.75 on what is left keeps tokens {0, 1}; top_p first would keep {0, 1, 2}. */
    {
        const float pr[6] = {0.5f, 0.2f, 0.1f, 0.1f, 0.05f, 0.05f};
        float lg[6];
        for (int i = 0; i < 6; i++)
            lg[i] = logf(pr[i]);
        sampling_params q = params_seeded(11);
        q.min_p = 0.15f;
        q.top_p = 0.75f;
        double expected[6];
        int counts[6];
        ref_probs(&q, NULL, lg, 6, expected);
        CHECK(expected[0] > 0 && expected[1] > 0 && expected[2] == 0);
        draw_counts(&q, lg, 6, counts);
        CHECKF(counts_match(counts, expected, 6, true), "min_p before top_p");
    }
    /* the bound can fail: draws at temperature 1 do not pass for 0.8 */
    sampling_params p = params_seeded(5), q = params_seeded(5);
    q.temperature = 0.8f;
    double expected[V];
    int counts[V];
    ref_probs(&q, NULL, small_logits, V, expected);
    draw_counts(&p, small_logits, V, counts);
    CHECK(!counts_match(counts, expected, V, false));
}

/* sampler_probs must equal the reference distribution exactly (up to float
 * rounding) on a realistic vocabulary, including which tokens are kept. */
static void test_probs_large_vocab(int quantised) {
    enum { V = 50272 };
    float *base = malloc(V * sizeof *base), *buf = malloc(V * sizeof *buf);
    float *probs = malloc(V * sizeof *probs);
    double *expected = malloc(V * sizeof *expected);
    for (int i = 0; i < V; i++)
        /* quantised logits put many ties at the top_k and top_p boundaries */
        base[i] = quantised ? roundf(2 * test_normal()) * 0.5f : 2.5f * test_normal();
    struct {
        float temperature, top_p, min_p;
        int top_k;
    } cases[] = {
        {1.0f, 1.0f, 0.0f, 0},  {0.8f, 0.9f, 0.0f, 0},  {1.0f, 0.5f, 0.0f, 50},
        {1.2f, 1.0f, 0.0f, 40}, {1.0f, 1.0f, 0.01f, 0}, {0.9f, 0.95f, 0.001f, 200},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        sampling_params p = params_seeded(1);
        p.temperature = cases[c].temperature;
        p.top_p = cases[c].top_p;
        p.min_p = cases[c].min_p;
        p.top_k = cases[c].top_k;
        sampler *s = sampler_create(&p, V, 0);
        memcpy(buf, base, V * sizeof *buf);
        CHECK(sampler_probs(s, buf, probs) == 0);
        ref_probs(&p, NULL, base, V, expected);
        int support_diff = 0, kept = 0;
        double maxdiff = 0, sum = 0;
        for (int t = 0; t < V; t++) {
            support_diff += (probs[t] > 0) != (expected[t] > 0);
            kept += expected[t] > 0;
            sum += probs[t];
            double d = fabs(probs[t] - expected[t]);
            if (d > maxdiff) maxdiff = d;
        }
        CHECKF(support_diff == 0, "case %zu/%d: %d tokens kept/dropped differently (of %d kept)", c,
               quantised, support_diff, kept);
        CHECKF(maxdiff < 1e-5, "case %zu/%d: max prob diff %g", c, quantised, maxdiff);
        CHECKF(fabs(sum - 1) < 1e-4, "case %zu/%d: probs sum to %g", c, quantised, sum);
        sampler_free(s);
    }
    free(base);
    free(buf);
    free(probs);
    free(expected);
}

static void test_penalties(void) {
    enum { V = 40 };
    const int32_t prompt[] = {1, 2, 2, 5, 30, 39};
    const int32_t wanted_out[] = {3, 3, 5, 7, 3, 11};
    const int n_out = 6;
    for (int variant = 0; variant < 3; variant++) {
        sampling_params p = params_seeded(3);
        p.repetition_penalty = variant == 1 ? 1.0f : 1.3f;
        p.presence_penalty = variant == 2 ? 0.0f : 0.5f;
        p.frequency_penalty = variant == 2 ? -0.7f : 0.25f;
        p.temperature = variant == 0 ? 0.0f : 0.5f;
        sampler *s = sampler_create(&p, V, 0);
        sampler_add_prompt(s, prompt, 6);
        float base[V], buf[V];
        for (int i = 0; i < V; i++)
            base[i] = 2 * test_normal();
        base[39] = 0.0f; /* a zero logit stays zero under the repetition penalty */
        /* steer the output: a huge bump makes the wanted token win */
        for (int i = 0; i < n_out; i++) {
            memcpy(buf, base, sizeof buf);
            buf[wanted_out[i]] += 1000;
            CHECK(sampler_sample(s, buf) == wanted_out[i]);
        }
        memcpy(buf, base, sizeof buf);
        sampler_sample(s, buf); /* penalties (and temperature) leave buf processed */
        ref_hist h = {prompt, 6, wanted_out, n_out};
        double expected[V];
        ref_penalise(&p, &h, base, expected, V);
        double maxdiff = 0;
        for (int t = 0; t < V; t++) {
            double e = p.temperature > 0 ? expected[t] / p.temperature : expected[t];
            double d = fabs(buf[t] - e) / (1 + fabs(e));
            if (d > maxdiff) maxdiff = d;
        }
        CHECKF(maxdiff < 1e-5, "variant %d: penalised logits differ by %g", variant, maxdiff);
        /* and at least one changed, so the check has teeth */
        CHECK(fabs(buf[3] - base[3] / (p.temperature > 0 ? p.temperature : 1)) > 0.1);
        sampler_free(s);
    }

    /* Draws follow the penalised distribution. The history grows with each
     * draw, so each draw gets a fresh sampler with the same history. */
    enum { SV = 10 };
    const int32_t pr[] = {4, 5, 5};
    const int32_t out[] = {9, 1, 9};
    sampling_params p = params_seeded(0);
    p.repetition_penalty = 1.5f;
    p.presence_penalty = 0.4f;
    p.frequency_penalty = 0.3f;
    p.top_k = 7;
    p.temperature = 0.9f;
    int counts[SV] = {0};
    float buf[SV];
    for (int i = 0; i < NDRAWS; i++) {
        p.seed = 1000 + i;
        sampler *s = sampler_create(&p, SV, 0);
        sampler_add_prompt(s, pr, 3);
        for (int j = 0; j < 3; j++) {
            memcpy(buf, small_logits, sizeof buf);
            buf[out[j]] += 1000;
            sampler_sample(s, buf);
        }
        memcpy(buf, small_logits, sizeof buf);
        counts[sampler_sample(s, buf)]++;
        sampler_free(s);
    }
    double expected[SV];
    ref_hist h = {pr, 3, out, 3};
    ref_probs(&p, &h, small_logits, SV, expected);
    CHECKF(counts_match(counts, expected, SV, true), "empirical distribution with penalties");
}

static void test_logprobs(void) {
    enum { V = 5000 };
    float *base = malloc(V * sizeof *base), *buf = malloc(V * sizeof *buf);
    for (int i = 0; i < V; i++)
        base[i] = 3 * test_normal();
    base[17] = base[18] = 20; /* a tie at the top */
    double mx = -INFINITY, z = 0;
    for (int i = 0; i < V; i++)
        mx = fmax(mx, base[i]);
    for (int i = 0; i < V; i++)
        z += exp(base[i] - mx);
    double lse = mx + log(z);
    CHECK(fabs(sampler_logsumexp(base, V) - lse) < 1e-9 * fabs(lse) + 1e-9);

    int32_t ids[8];
    float lps[8];
    CHECK(sampler_top_logprobs(base, V, 8, ids, lps) == 8);
    CHECK(ids[0] == 17 && ids[1] == 18);
    int *order = malloc(V * sizeof *order);
    double *key = malloc(V * sizeof *key);
    for (int i = 0; i < V; i++) {
        order[i] = i;
        key[i] = base[i];
    }
    g_sort_key = key;
    qsort(order, V, sizeof *order, by_key_desc);
    bool same = true;
    for (int j = 0; j < 8; j++)
        same = same && ids[j] == order[j] && fabs(lps[j] - (base[order[j]] - lse)) < 1e-5;
    CHECK(same);
    CHECK(sampler_top_logprobs(base, 3, 8, ids, lps) == 3);

    /* the reported logprob is the raw one even with penalties and temperature */
    sampling_params p = params_seeded(9);
    p.temperature = 0.6f;
    p.repetition_penalty = 1.2f;
    p.presence_penalty = 1.0f;
    sampler *s = sampler_create(&p, V, 0);
    const int32_t prompt[] = {17, 3, 4};
    sampler_add_prompt(s, prompt, 3);
    bool all_raw = true;
    for (int i = 0; i < 50; i++) {
        memcpy(buf, base, V * sizeof *buf);
        float lp = 0;
        int32_t top_id[2];
        float top_lp[2];
        int32_t t = sampler_sample_logprobs(s, buf, 2, &lp, top_id, top_lp);
        all_raw = all_raw && t >= 0 && fabs(lp - (base[t] - lse)) < 1e-5 && top_id[0] == 17 &&
                  top_id[1] == 18;
    }
    CHECK(all_raw);
    sampler_free(s);
    free(order);
    free(key);
    free(base);
    free(buf);
}

static void test_speed(void) {
    enum { V = 50272, N = 200 };
    float *base = malloc(V * sizeof *base), *buf = malloc(V * sizeof *buf);
    for (int i = 0; i < V; i++)
        base[i] = 2.5f * test_normal();
    struct {
        const char *name;
        float top_p, min_p;
        int top_k;
        float rep;
    } cases[] = {
        {"plain", 1.0f, 0.0f, 0, 1.0f},
        {"top_p 0.9", 0.9f, 0.0f, 0, 1.0f},
        {"top_k 50 + top_p 0.9", 0.9f, 0.0f, 50, 1.0f},
        {"min_p 0.05 + repetition", 1.0f, 0.05f, 0, 1.2f},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        sampling_params p = params_seeded(c);
        p.top_p = cases[c].top_p;
        p.min_p = cases[c].min_p;
        p.top_k = cases[c].top_k;
        p.repetition_penalty = cases[c].rep;
        sampler *s = sampler_create(&p, V, 0);
        int32_t prompt[512];
        for (int i = 0; i < 512; i++)
            prompt[i] = (i * 7919) % V;
        sampler_add_prompt(s, prompt, 512);
        double best = 1e9;
        for (int round = 0; round < 3; round++) {
            struct timespec t0, t1;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            for (int i = 0; i < N; i++) {
                memcpy(buf, base, V * sizeof *buf);
                sampler_sample(s, buf);
            }
            clock_gettime(CLOCK_MONOTONIC, &t1);
            double per = ((t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec)) / N;
            if (per < best) best = per;
        }
        printf("sample, vocab %d, %s: %.1f us\n", V, cases[c].name, best * 1e6);
        /* Informational only: speed targets live in benchmarks, not in unit tests. */
        sampler_free(s);
    }
    free(base);
    free(buf);
}

int main(void) {
    test_validate();
    test_greedy();
    test_seeds();
    test_distributions();
    test_probs_large_vocab(0);
    test_probs_large_vocab(1);
    test_penalties();
    test_logprobs();
    test_speed();
    return test_finish();
}
