/* libFuzzer target: llm.c model files (train/llmc.c), which a job names as model.init_from.
 *
 * Input: the file. It is peeked as submit does (td_weights_gpt_peek); a file that passes is loaded
 * into a model of its dimensions as a run does (td_weights_gpt_load), every parameter compared with
 * the file's bytes, and loaded into a model of other dimensions, which must be refused. The
 * model is then saved (td_weights_gpt_save_llmc, in the scratch directory) and peeked and loaded
 * again: the same dimensions and the same parameters. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train/engine.h"
#include "tests/fuzz/fuzz.h"
#include "train/llmc.h"
#include "train/weights.h"

static td_gpt model, copy; /* a td_gpt holds a view of every layer: too large for the stack */

/* Declares m with dimensions d and acquires its parameters in p. */
static void make_model(td_gpt *m, td_params *p, const td_gpt_dims *d)
{
    td_error_t err;

    memset(p, 0, sizeof(*p));
    TDF_CHECK(td_gpt_declare(m, p, d, &err) == 0);
    TDF_CHECK(td_params_alloc(p, 0) == 0);
    td_gpt_bind(m);
}

/* Every tensor of m, in order, is the file's parameters after its header. */
static void check_params(const td_gpt *m, const uint8_t *file, size_t size)
{
    size_t off = TD_LLMC_HEADER;

    for (int i = 0; i < TD_GPT_TENSORS; i++) {
        size_t bytes = m->p[i].n * sizeof(float);
        TDF_CHECK(off + bytes <= size);
        TDF_CHECK(memcmp(m->p[i].data, file + off, bytes) == 0);
        off += bytes;
    }
    TDF_CHECK(off == size);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[512], saved[512];
    td_gpt_dims d, d2;
    td_params p, p2;
    td_error_t err;
    int rc;

    tdf_write(path, sizeof(path), "model.bin", data, size);
    rc = td_weights_gpt_peek(path, 0, &d, &err);
    if (rc != 0) {
        TDF_CHECK(rc == TD_EDATA && err.msg[0] != '\0');
        return 0;
    }
    TDF_CHECK(TD_LLMC_HEADER + td_gpt_num_params(&d) * sizeof(float) == size);
    make_model(&model, &p, &d);
    TDF_CHECK(td_weights_gpt_load(path, &model, &err) == 0);
    check_params(&model, data, size);

    /* a model of other dimensions is refused before anything is read into it */
    d2 = d;
    d2.L = d.L == 1 ? 2 : 1;
    make_model(&copy, &p2, &d2);
    TDF_CHECK(td_weights_gpt_load(path, &copy, &err) == TD_ESHAPE);
    td_params_free(&p2);

    tdf_path(saved, sizeof(saved), "saved.bin");
    TDF_CHECK(td_weights_gpt_save_llmc(saved, &model, &err) == 0);
    TDF_CHECK(td_weights_gpt_peek(saved, 0, &d2, &err) == 0 && memcmp(&d, &d2, sizeof(d)) == 0);
    make_model(&copy, &p2, &d2);
    TDF_CHECK(td_weights_gpt_load(saved, &copy, &err) == 0);
    check_params(&copy, data, size);
    td_params_free(&p2);
    td_params_free(&p);
    return 0;
}
