/* The CUDA backend's first file: asks the CUDA runtime how many devices this process sees,
 * and why not when it cannot tell. Owns nothing. */
#include <cuda_runtime.h>
#include <stdio.h>

extern "C" {
#include "common/td_errno.h" /* C declarations without a linkage block of their own */
}
#include "kernels/cuda/td_cuda.h"

/* "12.2" for CUDA's version number 12020. */
static void version(char *out, size_t size, int v)
{
    snprintf(out, size, "%d.%d", v / 1000, (v % 1000) / 10);
}

/* td_cuda.h: no device and no driver at all are a CPU box; a driver too old for this runtime
 * is an error naming both versions, so that it is never mistaken for "no GPU". */
extern "C" int td_cuda_devices(int *n, td_error_t *err)
{
    int count = 0, driver = 0, runtime = 0;
    char dv[16], rv[16];
    cudaError_t e = cudaGetDeviceCount(&count);

    *n = 0;
    if (e == cudaSuccess) {
        *n = count;
        return 0;
    }
    (void)cudaGetLastError(); /* clear the runtime's last-error slot */
    if (e == cudaErrorNoDevice)
        return 0;
    (void)cudaDriverGetVersion(&driver); /* 0: no driver is installed */
    (void)cudaRuntimeGetVersion(&runtime);
    (void)cudaGetLastError();
    if (e == cudaErrorInsufficientDriver && driver == 0)
        return 0;
    version(dv, sizeof(dv), driver);
    version(rv, sizeof(rv), runtime);
    if (e == cudaErrorInsufficientDriver)
        return td_error_set(err, TD_ECUDA,
                            "the NVIDIA driver supports CUDA %s, older than this traind's CUDA "
                            "runtime %s: update the driver",
                            dv, rv);
    return td_error_set(err, TD_ECUDA, "cudaGetDeviceCount: %s: %s (driver CUDA %s, runtime %s)",
                        cudaGetErrorName(e), cudaGetErrorString(e), dv, rv);
}

/* Devices visible to this process, without the message (kernels.h). */
extern "C" int td_cuda_device_count(int *n)
{
    td_error_t err;

    return td_cuda_devices(n, &err);
}
