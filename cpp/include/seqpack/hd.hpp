#pragma once
// Functions compiled for both sides: plain inline C++ for the host compiler,
// __host__ __device__ under nvcc. The arithmetic and index decoding the CUDA
// kernels run lives in such functions, so the CPU kernels and the GoogleTest
// suite run the very same code.
#if defined(__CUDACC__)
#define SEQPACK_HD __host__ __device__ __forceinline__
#define SEQPACK_UNROLL _Pragma("unroll")
#else
#define SEQPACK_HD inline __attribute__((always_inline))
#define SEQPACK_UNROLL
#endif
