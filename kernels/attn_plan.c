/* kernels/attn_plan.c - the fused attention's blocks (attn_plan.h): which rows of which
 * sequences each block covers, for cpu.c, cuda/ops.cu and anyone counting their calls. */
#include "kernels/attn_plan.h"

#include <stdint.h>

/* Rows of the rows-of-every-sequence block that starts at r0: chunk, or when causal the most
 * whose rows * (r0 + rows) scores fit in chunk * Nk, aligned down to TD_ATTN_ALIGN unless
 * that would leave fewer than chunk. */
static int rows_at(const td_attn_dims *d, int r0)
{
    int64_t room = (int64_t)d->chunk * d->Nk;
    int left = d->Nq - r0, rows = d->chunk;

    if (d->causal) {
        /* rows * (r0 + rows) grows with rows, and chunk fits (r0 + chunk <= Nq = Nk while it
         * is not the last block): bisect [chunk, left] for the largest that fits, in integers */
        int64_t lo = d->chunk, hi = left;
        while (lo < hi) {
            int64_t mid = lo + (hi - lo + 1) / 2;
            if (mid * (r0 + mid) <= room)
                lo = mid;
            else
                hi = mid - 1;
        }
        rows = (int)lo;
        if (rows < left && rows - rows % TD_ATTN_ALIGN >= d->chunk)
            rows -= rows % TD_ATTN_ALIGN;
    }
    return rows < left ? rows : left;
}

/* Blocks the rows way takes: one a step of rows_at over the query rows. */
static int rows_blocks(const td_attn_dims *d)
{
    int n = 0;

    for (int r0 = 0; r0 < d->Nq; r0 += rows_at(d, r0))
        n++;
    return n;
}

/* Whole sequences that fit in the block; 0 when not even one does. */
static int seqs_fit(const td_attn_dims *d)
{
    size_t block = (size_t)d->B * d->NH * d->chunk * d->Nk;
    size_t seq = (size_t)d->NH * d->Nq * d->Nk;
    size_t n = block / seq;

    return n > (size_t)d->B ? d->B : (int)n;
}

int td_attn_next(const td_attn_dims *d, td_attn_block *k)
{
    if (d->B <= 0 || d->NH <= 0 || d->Nq <= 0 || d->Nk <= 0 || d->chunk < 1)
        return 0;
    if (k->nb == 0) { /* the first: choose the way */
        int per = seqs_fit(d);
        k->by_seq = per > 0 && (d->B + per - 1) / per <= rows_blocks(d);
        k->index = 0;
        k->b0 = 0;
        k->r0 = 0;
        k->nb = k->by_seq ? per : d->B;
        k->rows = k->by_seq ? d->Nq : rows_at(d, 0);
    } else if (k->by_seq) {
        if (k->b0 + k->nb >= d->B)
            return 0;
        k->b0 += k->nb;
        k->nb = d->B - k->b0 < k->nb ? d->B - k->b0 : k->nb;
        k->index++;
    } else {
        if (k->r0 + k->rows >= d->Nq)
            return 0;
        k->r0 += k->rows;
        k->rows = rows_at(d, k->r0);
        k->index++;
    }
    k->cols = d->causal ? k->r0 + k->rows : d->Nk;
    return 1;
}

int td_attn_by_seq(const td_attn_dims *d)
{
    td_attn_block k = {0};

    return td_attn_next(d, &k) && k.by_seq;
}

void td_attn_plan(const td_attn_dims *d, td_attn_calls *c)
{
    td_attn_block k = {0};
    int reads = 0; /* blocks that read sequence 0's keys: every block does, or one in the
                    * whole-sequences way */

    *c = (td_attn_calls){0};
    c->kernels_bwd = d->B > 0 && d->NH > 0 && d->Nq > 0 && d->Nk > 0 && d->chunk >= 1;
    while (td_attn_next(d, &k)) {
        size_t floats = (size_t)k.nb * d->NH * k.rows * k.cols;
        c->blocks++;
        c->by_seq = k.by_seq;
        c->gemms_fwd += 2;
        c->gemms_bwd += 5;
        c->kernels_fwd += 2;
        c->kernels_bwd += 2;
        reads += k.b0 == 0;
        c->min_rows = c->blocks == 1 || k.rows < c->min_rows ? k.rows : c->min_rows;
        c->block_floats = floats > c->block_floats ? floats : c->block_floats;
    }
    c->kv_reads = reads;
    if (c->blocks > 0 && d->causal && !c->by_seq)
        c->kernels_bwd += 2;
}
