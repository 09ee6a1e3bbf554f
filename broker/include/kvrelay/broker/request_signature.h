#pragma once

// The front proxy signs the kv_transfer_params.kvrelay object it injects with the node key; the
// KV path verifies it on every lookup, publish and prefill report a worker sends, so fields a
// client wrote itself (talking to the engine around the proxy) are never believed
// (docs/security.md). The signature authenticates where the fields came from; it is not
// bound to the prompt, so whoever can read a signed object (the worker) could replay it.

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <string_view>

namespace kvrelay::broker {

inline constexpr const char* kSignatureField = "signature";

// HMAC-SHA256 under `node_key` of the object's canonical form (every field but "signature",
// keys sorted, nlohmann's compact dump), as 64 lowercase hex digits.
[[nodiscard]] std::string request_signature(const nlohmann::json& kvrelay, std::string_view node_key);
// Sets kvrelay["signature"].
void sign_request_context(nlohmann::json& kvrelay, std::string_view node_key);
// Whether kvrelay["signature"] is the object's signature; compared in constant time.
[[nodiscard]] bool request_signature_valid(const nlohmann::json& kvrelay, std::string_view node_key);

}  // namespace kvrelay::broker
