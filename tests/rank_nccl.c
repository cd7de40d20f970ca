/* The NCCL bootstrap of a job over processes, without a GPU (issue 20): run under mpirun
 * (tests/rank_test.sh), every process makes a spanning cuda group of one local rank; global
 * rank 0's ncclGetUniqueId travels by MPI_Bcast, and every process must end with the same id
 * (compared by digest). Exits 0 when they do, 1 with a message when not, 77 when NCCL cannot
 * make an id on this machine. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "train/device.h"

int main(int argc, char **argv)
{
    td_error_t err = {0};
    td_group *g = NULL;
    uint64_t mine = 0, *all;
    int n, rc;

    if (td_world_init(&argc, &argv, &err) != 0) {
        fprintf(stderr, "rank_nccl: %s\n", err.msg);
        return 1;
    }
    n = td_world_size();
    if (td_group_new_spanning(&g, TD_DEVICE_CUDA, 1, 30.0, &err) != 0) {
        fprintf(stderr, "rank_nccl: td_group_new_spanning: %s\n", err.msg);
        td_world_finalize();
        return 1;
    }
    rc = td_group_id_digest(g, &mine, &err);
    all = calloc((size_t)n, sizeof(*all));
    if (all == NULL || td_world_allgather(&mine, sizeof(mine), all, &err) != 0) {
        fprintf(stderr, "rank_nccl: gathering the digests: %s\n", err.msg);
        return 1;
    }
    if (td_world_rank() == 0) {
        if (rc != 0) {
            printf("rank_nccl: no NCCL id on this machine: %s\n", err.msg);
            rc = 77;
        } else {
            rc = 0;
            for (int i = 0; i < n; i++)
                if (all[i] != all[0]) {
                    printf("rank_nccl: process %d has NCCL id %016" PRIx64 ", rank 0 %016" PRIx64
                           "\n",
                           i, all[i], all[0]);
                    rc = 1;
                }
            if (rc == 0)
                printf("rank_nccl: %d processes share rank 0's NCCL id %016" PRIx64 "\n", n,
                       all[0]);
        }
    }
    free(all);
    td_group_free(g);
    td_world_finalize();
    return td_world_rank() == 0 ? rc : 0;
}
