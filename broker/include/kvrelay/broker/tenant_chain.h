#pragma once

// Tenant isolation on the KV path (docs/security.md). Two mechanisms, each needed:
// - chain roots: a tenant's block-hash chains start at a root derived from its secret salt and
//   the request's cache_salt, so identical prompts of different tenants (or salts) hash to
//   different, unguessable chains and peer summaries advertise only salted hashes;
// - store scopes: where a policy has tenants, the KV path files every committed entry under a key
//   that also names the tenant of the verified kvrelay fields that committed it, and a lookup
//   reads only the keys of its own verified tenant. A worker's client that went around the front
//   proxy (forged or unsigned fields) is in the default tenant's scope, even if it learned a
//   tenant's chain root.

#include <string_view>

#include "kvrelay/core/block_hash.h"
#include "kvrelay/kv_store/entry.h"

namespace kvrelay::broker {

// HMAC-SHA256 keyed by `tenant_salt` of "kvrelay chain root v1", a zero byte and `cache_salt`,
// its first 8 bytes little-endian. No salt and no cache salt: kRootBlockHash (the unsalted
// default chain, which independent sidecars share by design).
[[nodiscard]] BlockHash derive_chain_root(std::string_view tenant_salt, std::string_view cache_salt);

// The store scope's key of an entry is kv_store::tenant_scoped_key (kv_store/entry_chain.h).

}  // namespace kvrelay::broker
