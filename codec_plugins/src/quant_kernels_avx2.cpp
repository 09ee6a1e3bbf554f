// The quantizer loops built with -mavx2 -mf16c (see codec_plugins/CMakeLists.txt); only called
// after cpu_path.cpp has checked the CPU for both.

#if !defined(__AVX2__) || !defined(__F16C__)
#error "quant_kernels_avx2.cpp needs -mavx2 -mf16c"
#endif
#if defined(__FMA__)
#error "FMA would round differently from the baseline build and the CUDA kernels"
#endif

#include "quant_kernels.h"

namespace kvrelay::codec::detail {

const QuantKernelTable& avx2_quant_kernels() noexcept {
  static constexpr QuantKernelTable kTable{kernels_for<DType::kFloat32>(), kernels_for<DType::kFloat16>(),
                                           kernels_for<DType::kBFloat16>()};
  return kTable;
}

}  // namespace kvrelay::codec::detail
