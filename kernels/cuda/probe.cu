/* The CUDA backend's first file: asks the CUDA runtime how many devices this process sees.
 * Small on purpose; it keeps the nvcc build, the cudart link and the error mapping of
 * kernels.h exercised until the CUDA kernels land beside it. Owns nothing. */
#include <cuda_runtime.h>

#include "kernels.h"
extern "C" {
#include "td_errno.h"
}

/* Devices visible to this process. "No device" and "no (usable) driver" are a CPU box, not a
 * failure: *n = 0 and 0. Any other runtime error is TD_ECUDA with *n = 0. */
extern "C" int td_cuda_device_count(int *n)
{
    int count = 0;
    int rc = 0;
    cudaError_t e = cudaGetDeviceCount(&count);

    switch (e) {
    case cudaSuccess:
        break;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
        (void)cudaGetLastError(); /* clear the runtime's last-error slot */
        count = 0;
        break;
    default:
        (void)cudaGetLastError();
        count = 0;
        rc = TD_ECUDA;
        break;
    }
    *n = count;
    return rc;
}
