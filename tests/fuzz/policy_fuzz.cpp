// Fuzzes the policy loader: any byte string must yield a Policy or a diagnostic, never a crash,
// and every diagnostic line must name the source and a JSON pointer.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "kvrelay/core/policy.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto policy = kvrelay::parse_policy(text, "fuzz.json");
  if (!policy) {
    const auto& message = policy.error().message;
    if (message.rfind("fuzz.json: ", 0) != 0) std::abort();
  } else if (policy.value().listen.http.host.empty()) {
    std::abort();  // listen.http is required: an accepted policy always has a host
  }
  return 0;
}
