#pragma once
// Host-side queries of the CUDA runtime. Later kernels (pack/unpack, log-probs)
// add their launchers beside these; none of this code knows about Python.
#include <string>

namespace seqpack::cuda {

// Number of visible CUDA devices; 0 when there is no driver or no device
// (never throws, so a CPU-only machine can ask safely).
int device_count() noexcept;

// CUDA runtime version this object was compiled against, e.g. 13000.
int runtime_version() noexcept;

// Human-readable name of device `index`, or an empty string when unavailable.
std::string device_name(int index);

}  // namespace seqpack::cuda
