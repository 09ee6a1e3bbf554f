#pragma once

// Which build of the CPU codec loops runs: the portable x86-64 one (SSE2), the AVX2 + F16C one
// or the AVX-512 (F, BW, VL, DQ) one. All write the same bytes; the fastest one the CPU supports
// is chosen at start-up. Forcing a path is for tests and benchmarks (it is process-wide).

#include <cstdint>
#include <optional>
#include <string_view>

namespace kvrelay::codec {

enum class CpuPath : std::uint8_t { kBaseline, kAvx2, kAvx512 };

[[nodiscard]] CpuPath active_cpu_path() noexcept;
[[nodiscard]] bool cpu_path_supported(CpuPath path) noexcept;
// Returns false (and changes nothing) when this CPU or build cannot run `path`.
bool force_cpu_path(CpuPath path) noexcept;
// Back to the fastest supported path.
void reset_cpu_path() noexcept;

[[nodiscard]] const char* cpu_path_name(CpuPath path) noexcept;
[[nodiscard]] std::optional<CpuPath> parse_cpu_path(std::string_view name) noexcept;

}  // namespace kvrelay::codec
