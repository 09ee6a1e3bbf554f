#include "sparse_selection.h"

#include <algorithm>
#include <cmath>

#include "kvrelay/decision/media.h"

namespace kvrelay::broker {

std::vector<TokenRun> sparse_keep(std::uint64_t tokens, double keep_ratio) {
  if (tokens == 0) return {};
  const double ratio = std::clamp(keep_ratio, 0.0, 1.0);
  auto kept = static_cast<std::uint64_t>(std::ceil(ratio * static_cast<double>(tokens)));
  kept = std::clamp<std::uint64_t>(kept, std::min<std::uint64_t>(tokens, kSparseSinkTokens + 1), tokens);
  if (kept == tokens) return {TokenRun{0, static_cast<std::uint32_t>(tokens)}};
  const std::uint64_t sinks = std::min<std::uint64_t>(kSparseSinkTokens, kept - 1);
  const std::uint64_t recent = kept - sinks;
  std::vector<TokenRun> runs;
  if (sinks > 0) runs.push_back({0, static_cast<std::uint32_t>(sinks)});
  runs.push_back({static_cast<std::uint32_t>(tokens - recent), static_cast<std::uint32_t>(recent)});
  return runs;
}

double sparse_keep_ratio() {
  const auto* sparse = decision::find_builtin_medium("kv_sparse");
  return sparse != nullptr ? sparse->profile.ratio[decision::dtype_slot(DType::kFloat32)] : 1.0;
}

}  // namespace kvrelay::broker
