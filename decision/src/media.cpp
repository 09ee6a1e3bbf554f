#include "kvrelay/decision/media.h"

namespace kvrelay::decision {

double CodecProfile::ratio_for(DType dtype) const noexcept {
  switch (dtype) {
    case DType::kFloat32:
      return ratio[0];
    case DType::kFloat16:
      return ratio[1];
    case DType::kBFloat16:
      return ratio[2];
  }
  return ratio[0];
}

MediumSpec builtin_medium(std::string_view name) {
  MediumSpec spec;
  spec.name = std::string(name);
  // Ratios: quantised size over raw size for fp32 / fp16 / bf16 inputs (scales add ~3%).
  // Throughputs: single-core CPU codec speeds; fidelity and extra decode from calibration runs.
  if (name == "tokens") {
    spec.kind = MediumKind::kTokens;
  } else if (name == "kv_raw") {
    spec.kind = MediumKind::kKvLossless;
  } else if (name == "kv_lossless") {
    spec.kind = MediumKind::kKvLossless;
    spec.profile = CodecProfile{{0.80, 0.85, 0.85}, 600e6, 1.2e9, 1.0, 0.0};
  } else if (name == "kv_fp8") {
    spec.kind = MediumKind::kKvLossy;
    spec.profile = CodecProfile{{0.26, 0.52, 0.52}, 2.0e9, 3.0e9, 0.995, 0.005};
  } else if (name == "kv_int8") {
    spec.kind = MediumKind::kKvLossy;
    spec.profile = CodecProfile{{0.26, 0.52, 0.52}, 1.5e9, 2.5e9, 0.99, 0.01};
  } else if (name == "kv_int4") {
    spec.kind = MediumKind::kKvLossy;
    spec.profile = CodecProfile{{0.14, 0.27, 0.27}, 1.2e9, 2.0e9, 0.95, 0.06};
  } else if (name == "kv_sparse") {
    spec.kind = MediumKind::kKvSparse;
    spec.profile = CodecProfile{{0.30, 0.30, 0.30}, 3.0e9, 3.0e9, 0.97, 0.04};
  } else {
    // Plugin codecs start pessimistic (no compression, lossy) until measured.
    spec.kind = MediumKind::kKvLossy;
    spec.profile = CodecProfile{{1.0, 1.0, 1.0}, 1.0e9, 1.0e9, 0.99, 0.01};
  }
  return spec;
}

}  // namespace kvrelay::decision
