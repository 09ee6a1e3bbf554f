#include "kvrelay/codec_plugins/cpu_path.h"

#if defined(KVRELAY_CODEC_HAVE_AVX2)
#include <cpuid.h>
#endif

#include <atomic>

namespace kvrelay::codec {
namespace {

#if defined(KVRELAY_CODEC_HAVE_AVX2)
// F16C straight from CPUID: clang's __builtin_cpu_supports does not know "f16c" (the fuzz
// preset builds with clang); its OS state is the AVX state the avx2 check already requires.
bool f16c_available() noexcept {
  unsigned eax = 0;
  unsigned ebx = 0;
  unsigned ecx = 0;
  unsigned edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

bool avx2_available() noexcept {
#if defined(KVRELAY_CODEC_HAVE_AVX2)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") != 0 && f16c_available();
#else
  return false;
#endif
}

// The OS must save the vector state too: libgcc's check reads XCR0 as well as CPUID.
bool avx512_available() noexcept {
#if defined(KVRELAY_CODEC_HAVE_AVX512)
  __builtin_cpu_init();
  return avx2_available() && __builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("avx512bw") != 0 &&
         __builtin_cpu_supports("avx512vl") != 0 && __builtin_cpu_supports("avx512dq") != 0;
#else
  return false;
#endif
}

CpuPath fastest() noexcept {
  static const CpuPath path = avx512_available() ? CpuPath::kAvx512
                              : avx2_available() ? CpuPath::kAvx2
                                                 : CpuPath::kBaseline;
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
  switch (path) {
    case CpuPath::kBaseline:
      return true;
    case CpuPath::kAvx2:
      return avx2_available();
    case CpuPath::kAvx512:
      return avx512_available();
  }
  return false;
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
  switch (path) {
    case CpuPath::kBaseline:
      return "baseline";
    case CpuPath::kAvx2:
      return "avx2";
    case CpuPath::kAvx512:
      return "avx512";
  }
  return "baseline";
}

std::optional<CpuPath> parse_cpu_path(std::string_view name) noexcept {
  if (name == "baseline") return CpuPath::kBaseline;
  if (name == "avx2") return CpuPath::kAvx2;
  if (name == "avx512") return CpuPath::kAvx512;
  return std::nullopt;
}

}  // namespace kvrelay::codec
