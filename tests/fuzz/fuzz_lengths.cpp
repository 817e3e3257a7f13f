// int64_from_buffer, the conversion behind every lengths argument: any width,
// signedness, stride (negative included) and byte order, compared with a
// byte-by-byte decoding.
#include "fuzz.hpp"

using namespace seqpack;
using namespace seqpack_fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  IntBuffer b;
  b.itemsize = static_cast<int>(in.in_range(0, 9));
  b.is_signed = in.flag();
  b.swap_bytes = in.flag();
  const int64_t step = in.in_range(1, 3);
  const bool backwards = in.flag();
  std::vector<uint8_t> bytes(static_cast<size_t>(in.in_range(0, 256)));
  for (auto& v : bytes) v = static_cast<uint8_t>(in.bits(1));
  const int64_t item = std::max(b.itemsize, 1);
  const int64_t stride = step * item;
  b.size = bytes.size() < static_cast<size_t>(item) ? 0 : (static_cast<int64_t>(bytes.size()) - item) / stride + 1;
  b.stride_bytes = backwards ? -stride : stride;
  b.data = bytes.data() + (backwards && b.size > 0 ? (b.size - 1) * stride : 0);
  return run([&] {
    const auto out = int64_from_buffer(b, "fuzz_lengths", "lengths");
    FUZZ_REQUIRE(static_cast<int64_t>(out.size()) == b.size);
    FUZZ_REQUIRE(b.size == 0 || b.itemsize == 1 || b.itemsize == 2 || b.itemsize == 4 || b.itemsize == 8);
    for (int64_t i = 0; i < b.size; ++i) {
      const auto* p = static_cast<const uint8_t*>(b.data) + i * b.stride_bytes;
      unsigned __int128 u = 0;  // the item's value from its bytes, most significant first
      for (int j = 0; j < b.itemsize; ++j) {
        const int at = b.swap_bytes ? j : b.itemsize - 1 - j;  // little-endian host
        u = (u << 8) | p[at];
      }
      __int128 v = static_cast<__int128>(u);
      if (b.is_signed && (u >> (8 * b.itemsize - 1)) & 1) v -= static_cast<__int128>(1) << (8 * b.itemsize);
      FUZZ_REQUIRE(out[static_cast<size_t>(i)] == v);
    }
  });
}
