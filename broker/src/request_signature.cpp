#include "kvrelay/broker/request_signature.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <array>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

namespace kvrelay::broker {

namespace {

constexpr std::string_view kSignatureLabel{"kvrelay params v1\0", 18};

}  // namespace

std::string request_signature(const nlohmann::json& kvrelay, std::string_view node_key) {
  nlohmann::json fields = kvrelay;
  if (fields.is_object()) fields.erase(kSignatureField);
  std::string message(kSignatureLabel);
  // nlohmann's objects are sorted maps, so this dump is canonical whatever order a worker's JSON
  // library re-serialized the fields in; invalid UTF-8 is replaced as the workers replace it.
  message += fields.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
  unsigned int digest_bytes = 0;
  HMAC(EVP_sha256(), node_key.data(), static_cast<int>(node_key.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), digest.data(), &digest_bytes);
  std::string hex;
  hex.reserve(2 * digest_bytes);
  for (unsigned int index = 0; index < digest_bytes; ++index)
    hex += fmt::format("{:02x}", digest[index]);
  return hex;
}

void sign_request_context(nlohmann::json& kvrelay, std::string_view node_key) {
  kvrelay[kSignatureField] = request_signature(kvrelay, node_key);
}

bool request_signature_valid(const nlohmann::json& kvrelay, std::string_view node_key) {
  if (!kvrelay.is_object()) return false;
  const auto it = kvrelay.find(kSignatureField);
  if (it == kvrelay.end() || !it->is_string()) return false;
  const auto& claimed = it->get_ref<const std::string&>();
  const std::string expected = request_signature(kvrelay, node_key);
  return claimed.size() == expected.size() && CRYPTO_memcmp(claimed.data(), expected.data(), expected.size()) == 0;
}

}  // namespace kvrelay::broker
