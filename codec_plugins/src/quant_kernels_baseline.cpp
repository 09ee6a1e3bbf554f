// The quantizer loops for any x86-64 CPU (SSE2 vectors).

#include "quant_kernels.h"

namespace kvrelay::codec::detail {

const QuantKernelTable& baseline_quant_kernels() noexcept {
  static constexpr QuantKernelTable kTable{kernels_for<DType::kFloat32>(), kernels_for<DType::kFloat16>(),
                                           kernels_for<DType::kBFloat16>()};
  return kTable;
}

}  // namespace kvrelay::codec::detail
