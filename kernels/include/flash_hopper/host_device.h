// Function qualifiers for the few headers that are plain C++ as well as CUDA: the mask policy,
// the tile scheduler, the step schedule and the pipeline state. Host tests (tests/cpp/) compile
// them with g++ alone, so they must not need a CUDA or CuTe header.
#pragma once

#if defined(__CUDACC__)
#define FH_HOST_DEVICE __forceinline__ __host__ __device__
#else
#define FH_HOST_DEVICE inline
#endif
