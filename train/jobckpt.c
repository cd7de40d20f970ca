/* A job's checkpoints as the trainer and the tools beside it see them: the hash of what must
 * not change across a resume, the float sections a job's checkpoint holds, and the latest
 * checkpoint loaded into a model built for it alone (export, sampling, the embedder). The
 * files themselves are ckpt.c's. Called on the caller's thread; errors are returned, never
 * panicked. */
#include <stdlib.h>
#include <string.h>

#include "train/ckpt.h"
#include "train/sizes.h"

/* Feeds a string's bytes and its terminator (so "ab","c" and "a","bc" differ). */
static uint64_t hash_str(uint64_t h, const char *s)
{
    return td_ckpt_hash(h, s, strlen(s) + 1);
}

/* Feeds one field's bytes (a scalar: no padding inside). */
#define HASH(h, field) td_ckpt_hash((h), &(field), sizeof(field))

/* A sensorlm's model keys, field by field. */
static uint64_t hash_slm(uint64_t h, const td_sensorlm_config *m)
{
    h = HASH(h, m->size), h = HASH(h, m->time_steps), h = HASH(h, m->channels);
    h = HASH(h, m->patch_t), h = HASH(h, m->patch_c), h = HASH(h, m->s_width);
    h = HASH(h, m->s_depth), h = HASH(h, m->s_heads), h = HASH(h, m->s_mlp), h = HASH(h, m->pool);
    h = HASH(h, m->text_len), h = HASH(h, m->t_width), h = HASH(h, m->t_depth);
    h = HASH(h, m->t_heads), h = HASH(h, m->t_mlp), h = HASH(h, m->embed_dim);
    return h;
}

/* What must not change across a resume: the model, the data and its order, the optimizer,
 * the schedule and the length of the job (the schedule depends on it). Not the replica
 * layout (a job may resume on another number of devices: the global batch is the same),
 * threads, evaluation, checkpointing or fault injection. */
uint64_t td__train_config_hash(const td_train_config *c)
{
    uint64_t h = TD_CKPT_HASH_INIT;

    h = HASH(h, c->model);
    h = HASH(h, c->n_layers);
    h = td_ckpt_hash(h, c->layers, sizeof(int) * (size_t)(c->n_layers > 0 ? c->n_layers : 0));
    h = HASH(h, c->n_layer), h = HASH(h, c->n_head), h = HASH(h, c->n_embd);
    h = HASH(h, c->seq_len), h = HASH(h, c->vocab_size);
    h = hash_str(h, c->init_from);
    h = HASH(h, c->data);
    h = hash_str(hash_str(h, c->train.images), c->train.labels);
    h = HASH(h, c->n_train_files), h = HASH(h, c->n_valid_files);
    for (int i = 0; i < c->n_train_files && i < TD_MAX_PATTERNS; i++)
        h = hash_str(h, c->train_files[i]);
    for (int i = 0; i < c->n_valid_files && i < TD_MAX_PATTERNS; i++)
        h = hash_str(h, c->valid_files[i]);
    h = HASH(h, c->valid_fraction), h = HASH(h, c->shuffle), h = HASH(h, c->seed);
    h = HASH(h, c->optim), h = HASH(h, c->lr), h = HASH(h, c->beta1), h = HASH(h, c->beta2);
    h = HASH(h, c->eps), h = HASH(h, c->weight_decay), h = HASH(h, c->momentum);
    h = HASH(h, c->grad_clip);
    h = HASH(h, c->schedule), h = HASH(h, c->warmup), h = HASH(h, c->cooldown);
    h = HASH(h, c->min_lr);
    h = HASH(h, c->batch_size), h = HASH(h, c->epochs), h = HASH(h, c->max_steps);
    if (c->model == TD_MODEL_SENSORLM) /* only then: the other kinds' hashes stay as they were */
        h = hash_slm(h, &c->slm);
    /* Another chunk sums the attention's gradients in other blocks (on the CPU the bits agree
     * only when both chunks are multiples of its 64-row sgemms or cover the sequence), so a job
     * resumes with its own. Only when set, so the hash of a job that leaves it 0 stays as it
     * was before the key existed. */
    if (c->attn_chunk != 0)
        h = HASH(h, c->attn_chunk);
    /* Another loss is another job; only when set, as attn_chunk, so that the hash of a job
     * without the key stays as it was. */
    if (c->mask_same_label != 0)
        h = HASH(h, c->mask_same_label);
    if (c->same_label_weight != 0) {
        uint32_t bits;
        memcpy(&bits, &c->same_label_weight, sizeof(bits));
        h = HASH(h, bits);
    }
    return h;
}

int td__train_ckpt_sections(td_params *p, float *norm, int C, td_ckpt_section *s)
{
    int n = 0;

    s[n++] = (td_ckpt_section){.name = "params", .data = p->host_data, .count = p->n};
    if (p->host_m != NULL)
        s[n++] = (td_ckpt_section){.name = "m", .data = p->host_m, .count = p->n};
    if (p->host_v != NULL)
        s[n++] = (td_ckpt_section){.name = "v", .data = p->host_v, .count = p->n};
    if (norm != NULL)
        s[n++] = (td_ckpt_section){.name = "norm", .data = norm, .count = 2 * (size_t)C};
    return n;
}

/* The latest checkpoint of cfg's job into the nsec sections sec (the job's parameters declared
 * and allocated), refused when another configuration wrote it; its step into *step. */
static int load_latest(const td_train_config *cfg, td_ckpt_section *sec, int nsec, int64_t *step,
                       td_error_t *err)
{
    td_ckpt_meta meta;
    td_ckpt_found found;
    int rc = td_ckpt_load_latest(cfg->checkpoint_dir, &meta, sec, nsec, &found, err);

    if (rc == TD_ENOTFOUND)
        return td_error_set(err, rc, "no checkpoint in %s yet", cfg->checkpoint_dir);
    if (rc != 0)
        return rc;
    if (meta.config_hash != td__train_config_hash(cfg))
        return td_error_set(err, TD_ESTATE,
                            "%s was written by a job with another configuration (config hash "
                            "%016llx, this job's %016llx)",
                            found.path, (unsigned long long)meta.config_hash,
                            (unsigned long long)td__train_config_hash(cfg));
    *step = meta.step;
    return 0;
}

/* For export and sampling: a gpt job's model as of its latest checkpoint, with its moments
 * (so the checkpoint's sections match) and step. */
int td__train_load_gpt(const td_train_config *cfg, td_gpt *m, td_params *p, int64_t *step,
                       td_error_t *err)
{
    td_ckpt_section sec[4];
    td_gpt_dims d;
    int rc;

    if (cfg->model != TD_MODEL_GPT)
        return td_error_set(err, TD_EINVAL, "not a gpt job");
    if (cfg->checkpoint_dir[0] == '\0')
        return td_error_set(err, TD_ENOTFOUND, "the job has no checkpoint directory");
    rc = td__train_gpt_dims(cfg, &d, err);
    if (rc == 0)
        rc = td_gpt_declare(m, p, &d, err);
    if (rc != 0)
        return rc;
    m->attn_chunk = cfg->attn_chunk;
    if (td_params_alloc(p, td_optim_moments(cfg)) != 0)
        return td_error_set(err, TD_ENOMEM, "no memory for %zu parameters", p->n);
    td_gpt_bind(m);
    return load_latest(cfg, sec, td__train_ckpt_sections(p, NULL, 0, sec), step, err);
}

/* For embedders and export: a sensorlm job's model as of its latest checkpoint, with its
 * moments (so the checkpoint's sections match), step and statistics. */
int td__train_load_sensorlm(const td_train_config *cfg, td_sensorlm *m, td_params *p, int64_t *step,
                            float **norm, td_error_t *err)
{
    td_ckpt_section sec[4];
    td_slm_dims d;
    int rc;

    *norm = NULL;
    if (cfg->model != TD_MODEL_SENSORLM)
        return td_error_set(err, TD_EINVAL, "not a sensorlm job");
    if (cfg->checkpoint_dir[0] == '\0')
        return td_error_set(err, TD_ENOTFOUND, "the job has no checkpoint directory");
    rc = td__train_slm_dims(cfg, &d, NULL, err);
    if (rc == 0)
        rc = td_sensorlm_declare(m, p, &d, err);
    if (rc != 0)
        return rc;
    if (td_params_alloc(p, td_optim_moments(cfg)) != 0)
        return td_error_set(err, TD_ENOMEM, "no memory for %zu parameters", p->n);
    if ((*norm = malloc(2 * (size_t)d.C * sizeof(float))) == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for a model's window statistics");
    return load_latest(cfg, sec, td__train_ckpt_sections(p, *norm, d.C, sec), step, err);
}

/* For export: an mlp job's model as of its latest checkpoint, with its moments and step. */
int td__train_load_mlp(const td_train_config *cfg, td_mlp *m, td_params *p, int64_t *step,
                       td_error_t *err)
{
    td_ckpt_section sec[4];

    if (cfg->model != TD_MODEL_MLP)
        return td_error_set(err, TD_EINVAL, "not an mlp job");
    if (cfg->checkpoint_dir[0] == '\0')
        return td_error_set(err, TD_ENOTFOUND, "the job has no checkpoint directory");
    if (td_mlp_declare(m, p, cfg->layers, cfg->n_layers) != 0)
        return td_error_set(err, TD_EINVAL, "the job's layers cannot make an mlp");
    if (td_params_alloc(p, td_optim_moments(cfg)) != 0)
        return td_error_set(err, TD_ENOMEM, "no memory for %zu parameters", p->n);
    return load_latest(cfg, sec, td__train_ckpt_sections(p, NULL, 0, sec), step, err);
}
