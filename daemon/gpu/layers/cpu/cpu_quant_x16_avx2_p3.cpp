// The AVX2 x16 product's instances for three passes over x (cpu_quant_x16_avx2_tiles.h),
// compiled beside the other passes' files.

#include "cpu_quant_x16_avx2_tiles.h"

#if defined(LLMD_X16_AVX2)
namespace llmd_x16 {

template <>
void mm_x16_avx2_passes<3>(int64_t quant, const std::vector<QuantizedRow>& x, const uint8_t* w, int64_t n,
                           int64_t records, float* out) {
  mm_x16_every_type<3>(quant, x, w, n, records, out);
}

}  // namespace llmd_x16
#endif
