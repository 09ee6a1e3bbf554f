#include "trusted_context.h"

#include <nlohmann/json.hpp>

#include "kvrelay/broker/request_signature.h"

namespace kvrelay::broker {

Result<TrustedContext> trusted_request_context(const Policy& policy, std::string_view params_json) {
  TrustedContext trusted;
  if (!policy.signing.enabled()) {
    KVRELAY_TRY(trusted.context, parse_request_context(params_json));
    return trusted;
  }
  if (params_json.empty()) return trusted;
  const auto params = nlohmann::json::parse(params_json, nullptr, /*allow_exceptions=*/false);
  if (params.is_null()) return trusted;
  if (!params.is_object() || !params.contains(kSignatureField)) {
    trusted.ignored = "unsigned";
    return trusted;
  }
  if (!request_signature_valid(params, policy.signing.node_key)) {
    trusted.ignored = "forged";
    return trusted;
  }
  KVRELAY_TRY(trusted.context, request_context_from_json(params));  // parsed once, above
  return trusted;
}

}  // namespace kvrelay::broker
