/* td_export_llmc() and td_export_safetensors() of train.h: a job's latest checkpoint loaded
 * into a model of its own (jobckpt.c: no trainer, no dataset) and written out through
 * weights.h, an llm.c model file for a gpt, safetensors for a gpt or a sensorlm. Blocking file
 * I/O on the caller's thread (the daemon's threadpool); errors are returned, never panicked. */
#include <stdlib.h>

#include "train/sizes.h"
#include "train/weights.h"

int td_export_llmc(const td_train_config *cfg, const char *out_path, td_error_t *err)
{
    td_gpt *m = calloc(1, sizeof(*m));
    td_params p = {0};
    int64_t step;
    int rc;

    if (m == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for a model");
    rc = td__train_load_gpt(cfg, m, &p, &step, err);
    if (rc == 0)
        rc = td_weights_gpt_save_llmc(out_path, m, err);
    td_params_free(&p);
    free(m);
    return rc;
}

static int export_gpt(const td_train_config *cfg, const char *out_path, td_error_t *err)
{
    td_gpt *m = calloc(1, sizeof(*m));
    td_params p = {0};
    int64_t step = 0;
    int rc;

    if (m == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for a model");
    rc = td__train_load_gpt(cfg, m, &p, &step, err);
    if (rc == 0)
        rc = td_weights_gpt_save_st(out_path, m, step, err);
    td_params_free(&p);
    free(m);
    return rc;
}

static int export_sensorlm(const td_train_config *cfg, const char *out_path, td_error_t *err)
{
    td_sensorlm *m = calloc(1, sizeof(*m));
    td_params p = {0};
    float *norm = NULL;
    int64_t step = 0;
    int rc;

    if (m == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for a model");
    rc = td__train_load_sensorlm(cfg, m, &p, &step, &norm, err);
    if (rc == 0)
        rc = td_weights_slm_save_st(out_path, m, norm, step, err);
    free(norm);
    td_params_free(&p);
    free(m);
    return rc;
}

static int export_mlp(const td_train_config *cfg, const char *out_path, td_error_t *err)
{
    td_mlp m = {0};
    td_params p = {0};
    int64_t step = 0;
    int rc = td__train_load_mlp(cfg, &m, &p, &step, err);

    if (rc == 0)
        rc = td_weights_mlp_save_st(out_path, &m, step, err);
    td_params_free(&p);
    return rc;
}

int td_export_safetensors(const td_train_config *cfg, const char *out_path, td_error_t *err)
{
    if (cfg->model == TD_MODEL_GPT)
        return export_gpt(cfg, out_path, err);
    if (cfg->model == TD_MODEL_SENSORLM)
        return export_sensorlm(cfg, out_path, err);
    return export_mlp(cfg, out_path, err);
}
