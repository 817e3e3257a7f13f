#include "seqpack/cuda_device.hpp"

#include <cuda_runtime.h>

namespace seqpack::cuda {

int device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return count;
}

int runtime_version() noexcept { return CUDART_VERSION; }

std::string device_name(int index) {
  cudaDeviceProp prop{};
  if (index < 0 || index >= device_count() ||
      cudaGetDeviceProperties(&prop, index) != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  return prop.name;
}

}  // namespace seqpack::cuda
