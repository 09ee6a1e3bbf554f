#include "kvrelay/codec_plugins/cpu_path.h"

#include <atomic>

namespace kvrelay::codec {
namespace {

bool avx2_available() noexcept {
#if defined(KVRELAY_CODEC_HAVE_AVX2)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("f16c") != 0;
#else
  return false;
#endif
}

CpuPath fastest() noexcept {
  static const CpuPath path = avx2_available() ? CpuPath::kAvx2 : CpuPath::kBaseline;
  return path;
}

std::atomic<CpuPath>& current() noexcept {
  static std::atomic<CpuPath> path{fastest()};
  return path;
}

}  // namespace

CpuPath active_cpu_path() noexcept {
  return current().load(std::memory_order_relaxed);
}

bool cpu_path_supported(CpuPath path) noexcept {
  return path == CpuPath::kBaseline || avx2_available();
}

bool force_cpu_path(CpuPath path) noexcept {
  if (!cpu_path_supported(path)) return false;
  current().store(path, std::memory_order_relaxed);
  return true;
}

void reset_cpu_path() noexcept {
  current().store(fastest(), std::memory_order_relaxed);
}

const char* cpu_path_name(CpuPath path) noexcept {
  return path == CpuPath::kAvx2 ? "avx2" : "baseline";
}

std::optional<CpuPath> parse_cpu_path(std::string_view name) noexcept {
  if (name == "baseline") return CpuPath::kBaseline;
  if (name == "avx2") return CpuPath::kAvx2;
  return std::nullopt;
}

}  // namespace kvrelay::codec
