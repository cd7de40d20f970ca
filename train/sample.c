/* td_sample() of train.h: text generated from a gpt job's latest checkpoint. It builds the
 * model on its own (no trainer, no dataset) on the caller's thread and runs forwards under
 * its own panic boundary. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train/engine.h"
#include "common/td_panic.h"

#define TEXT_START '\n' /* a text job's first token when the prompt is empty */

/* The prompt as tokens: a text job's bytes, or a tokens job's ids (decimal, separated by
 * spaces or commas). An empty prompt starts from one token: a newline for text, the last of
 * the vocabulary for tokens (GPT-2's <|endoftext|> is 50256 of 50257). */
static int prompt_tokens(const td_train_config *cfg, int V, const char *prompt, int *tok, int cap,
                         td_error_t *err)
{
    int n = 0;

    if (cfg->data == TD_DATA_TEXT) {
        for (const unsigned char *s = (const unsigned char *)prompt; *s != '\0' && n < cap; s++)
            tok[n++] = *s;
    } else {
        const char *s = prompt;
        while (*s != '\0' && n < cap) {
            char *end;
            long v;
            while (*s == ' ' || *s == ',' || *s == '\n' || *s == '\t')
                s++;
            if (*s == '\0')
                break;
            v = strtol(s, &end, 10);
            if (end == s || v < 0 || v >= V)
                return td_error_set(err, TD_EINVAL, "prompt: '%.20s' is not a token id below %d", s,
                                    V);
            tok[n++] = (int)v;
            s = end;
        }
    }
    if (n == 0)
        tok[n++] = cfg->data == TD_DATA_TEXT ? TEXT_START : V - 1;
    return n;
}

/* The next token from the last row of logits: softmax at temperature over the V real tokens,
 * one uniform draw; temperature 0 is the argmax. */
static int pick(const float *logits, int V, float temperature, td_rng *rng)
{
    int best = 0;
    double sum = 0.0, u, acc = 0.0;
    float maxv = logits[0];

    for (int j = 1; j < V; j++)
        if (logits[j] > maxv)
            maxv = logits[j], best = j;
    if (temperature <= 0.0f)
        return best;
    for (int j = 0; j < V; j++)
        sum += exp((double)(logits[j] - maxv) / temperature);
    u = (double)td_rng_uniform(rng) * sum;
    for (int j = 0; j < V; j++) {
        acc += exp((double)(logits[j] - maxv) / temperature);
        if (u < acc)
            return j;
    }
    return V - 1;
}

/* Appends token to out as text (a byte) or as an id and a space. */
static void put_token(const td_train_config *cfg, int token, char *out, size_t outsize, size_t *len)
{
    char buf[16];
    int n;

    if (cfg->data == TD_DATA_TEXT) {
        buf[0] = (char)token;
        n = 1;
    } else {
        n = snprintf(buf, sizeof(buf), "%s%d", *len > 0 ? " " : "", token);
    }
    if (*len + (size_t)n < outsize) {
        memcpy(out + *len, buf, (size_t)n);
        *len += (size_t)n;
        out[*len] = '\0';
    }
}

/* Appends ntokens sampled tokens to tok (n of them so far), each one forward of the window
 * (the last maxT tokens) with no tape, and writes them to out; stops early, panicking with
 * TD_ECANCELLED, once *stop is set. May panic. */
static void generate_loop(const td_train_config *cfg, td_gpt *m, td_arena *arena, int *tok, int n,
                          int ntokens, float temperature, td_rng *rng, const atomic_int *stop,
                          char *out, size_t outsize)
{
    td_ctx c = {.k = td_kernels_cpu(), .arena = arena, .tape = NULL};
    int maxT = m->d.maxT;
    size_t len = 0;

    for (int i = 0; i < ntokens; i++, n++) {
        if (stop != NULL && atomic_load(stop))
            td_panic(TD_ECANCELLED, "stopped after %d of %d tokens", i, ntokens);
        int first = n > maxT ? n - maxT : 0, T = n - first;
        td_tensor *logits;
        td_arena_reset(arena);
        td_gpt_forward(&c, m, tok + first, NULL, 1, T, &logits);
        tok[n] = pick(logits->data + (size_t)(T - 1) * m->d.Vp, m->d.V, temperature, rng);
        put_token(cfg, tok[n], out, outsize, &len);
    }
}

/* generate_loop under a boundary. Returns 0 or the panic's code with err set. Nothing here
 * changes after setjmp, so no local needs volatile. */
static int try_generate(const td_train_config *cfg, td_gpt *m, td_arena *arena, int *tok, int n,
                        int ntokens, float temperature, td_rng *rng, const atomic_int *stop,
                        char *out, size_t outsize, td_error_t *err)
{
    td_boundary b;

    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        generate_loop(cfg, m, arena, tok, n, ntokens, temperature, rng, stop, out, outsize);
        td_boundary_leave(&b);
        return 0;
    }
    return td_error_set(err, b.err.code, "sampling: %s", b.err.msg);
}

/* The sampling arena (one forward of a full window, no gradients) around try_generate. */
static int generate(const td_train_config *cfg, td_gpt *m, int *tok, int n, int ntokens,
                    float temperature, uint64_t seed, const atomic_int *stop, char *out,
                    size_t outsize, td_error_t *err)
{
    td_arena arena = {0};
    td_rng rng;
    int rc;

    if (td_arena_init(&arena, td_gpt_arena_bytes(m, 1, m->d.maxT, 0)) != 0)
        return td_error_set(err, TD_ENOMEM, "no memory for the sampling arena");
    td_rng_seed(&rng, seed, 3);
    out[0] = '\0';
    rc = try_generate(cfg, m, &arena, tok, n, ntokens, temperature, &rng, stop, out, outsize, err);
    td_arena_free(&arena);
    return rc;
}

int td_sample(const td_train_config *cfg, const char *prompt, int ntokens, float temperature,
              uint64_t seed, const atomic_int *stop, char *out, size_t outsize, td_error_t *err)
{
    td_gpt *m = NULL;
    td_params p = {0};
    int64_t step;
    int *tok = NULL, n, rc;
    size_t cap;

    if (ntokens < 0 || outsize == 0 || !(temperature >= 0.0f) || prompt == NULL)
        return td_error_set(err, TD_EINVAL, "sample: %d tokens, temperature %g, %zu bytes out",
                            ntokens, temperature, outsize);
    m = calloc(1, sizeof(*m));
    if (m == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for a model");
    rc = td__train_load_gpt(cfg, m, &p, &step, err);
    if (rc != 0)
        goto out;
    cap = strlen(prompt) + (size_t)ntokens + 1;
    tok = malloc(cap * sizeof(int));
    if (tok == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "no memory for %zu tokens", cap);
        goto out;
    }
    n = prompt_tokens(cfg, m->d.V, prompt, tok, (int)cap - ntokens, err);
    rc = n < 0 ? n : generate(cfg, m, tok, n, ntokens, temperature, seed, stop, out, outsize, err);
out:
    free(tok);
    td_params_free(&p);
    free(m);
    return rc;
}
