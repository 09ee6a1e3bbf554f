#include "kvrelay/broker/tenant_chain.h"

#include <array>
#include <cstring>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <string>

namespace kvrelay::broker {

namespace {

constexpr std::string_view kChainRootLabel{"kvrelay chain root v1\0", 22};

}  // namespace

BlockHash derive_chain_root(std::string_view tenant_salt, std::string_view cache_salt) {
  if (tenant_salt.empty() && cache_salt.empty()) return kRootBlockHash;
  std::string message(kChainRootLabel);
  message.append(cache_salt);
  std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
  unsigned int digest_bytes = 0;
  HMAC(EVP_sha256(), tenant_salt.data(), static_cast<int>(tenant_salt.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), digest.data(), &digest_bytes);
  BlockHash root = 0;
  std::memcpy(&root, digest.data(), sizeof(root));  // little-endian hosts only, as the block hashes
  return root;
}

}  // namespace kvrelay::broker
