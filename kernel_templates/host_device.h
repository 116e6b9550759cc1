// MOEJIT_HOST_DEVICE: a function both the host and the kernels compile (the plain-C++ headers
// shared with the host: token_index_workspace.h, fp8_e4m3.h). No includes, as they have none.
#ifndef MOEJIT_HOST_DEVICE_H_
#define MOEJIT_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define MOEJIT_HOST_DEVICE __host__ __device__
#else
#define MOEJIT_HOST_DEVICE
#endif

#endif  // MOEJIT_HOST_DEVICE_H_
