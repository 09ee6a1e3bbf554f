// Tenant isolation's two primitives on their own: the chain root a tenant's salt and a request's
// cache_salt give, and the signature over the kvrelay fields the front proxy injects.

#include "kvrelay/broker/tenant_chain.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "kvrelay/broker/request_context.h"
#include "kvrelay/broker/request_signature.h"
#include "kvrelay/core/block_hash.h"
#include "kvrelay/kv_store/entry_chain.h"

#include "trusted_context.h"

using kvrelay::BlockHash;
using kvrelay::kRootBlockHash;
using namespace kvrelay::broker;
using nlohmann::json;

namespace {

const std::string kAcmeSalt = "acme-salt-0123456789abcdef";
const std::string kGlobexSalt = "globex-salt-0123456789abcdef";
const std::string kNodeKey = "node-key-0123456789abcdef";

}  // namespace

TEST_CASE("a tenant's salt and a request's cache salt each move the chain root", "[broker][tenant][security]") {
  CHECK(derive_chain_root("", "") == kRootBlockHash);  // the unsalted default chain
  const BlockHash acme = derive_chain_root(kAcmeSalt, "");
  CHECK(acme == derive_chain_root(kAcmeSalt, ""));  // deterministic: every node derives the same
  CHECK(acme != kRootBlockHash);
  CHECK(acme != derive_chain_root(kGlobexSalt, ""));
  CHECK(acme != derive_chain_root(kAcmeSalt, "s1"));
  CHECK(derive_chain_root(kAcmeSalt, "s1") != derive_chain_root(kAcmeSalt, "s2"));
  CHECK(derive_chain_root("", "s1") != kRootBlockHash);  // a cache salt alone salts the default tenant
  CHECK(derive_chain_root("", "s1") != derive_chain_root(kAcmeSalt, "s1"));

  // Identical prompts under different roots share no block hash, so no key.
  const std::vector<kvrelay::TokenId> tokens(64, 7);
  const auto default_chain = kvrelay::hash_blocks(42, tokens);
  const auto acme_chain = kvrelay::hash_blocks(42, tokens, kvrelay::kDefaultBlockTokens, acme);
  REQUIRE(acme_chain.size() == 4);
  for (const auto hash : acme_chain) {
    CHECK(std::find(default_chain.begin(), default_chain.end(), hash) == default_chain.end());
  }
  CHECK(kvrelay::hash_blocks(42, tokens, kvrelay::kDefaultBlockTokens, kRootBlockHash) == default_chain);
}

TEST_CASE("chain roots travel as 16 hex digits and nothing else parses", "[broker][tenant][security]") {
  const BlockHash root = derive_chain_root(kAcmeSalt, "x");
  CHECK(kvrelay::parse_block_hash_hex(kvrelay::block_hash_hex(root)) == root);
  CHECK(kvrelay::block_hash_hex(1) == "0000000000000001");
  CHECK_FALSE(kvrelay::parse_block_hash_hex("1"));
  CHECK_FALSE(kvrelay::parse_block_hash_hex("000000000000000g"));
  CHECK_FALSE(kvrelay::parse_block_hash_hex("-000000000000001"));
  CHECK_FALSE(kvrelay::parse_block_hash_hex("00000000000000001"));
}

TEST_CASE("store scopes differ per tenant and from the worker's own key", "[broker][tenant][security]") {
  const kvrelay::kv_store::EntryKey key{42, 0x1234};
  const auto acme = kvrelay::kv_store::tenant_scoped_key(key, "acme");
  CHECK(acme.model_id == key.model_id);
  CHECK(acme == kvrelay::kv_store::tenant_scoped_key(key, "acme"));
  CHECK(acme.context_hash != key.context_hash);
  CHECK(acme != kvrelay::kv_store::tenant_scoped_key(key, "globex"));
  CHECK(kvrelay::kv_store::tenant_scoped_key(key, "") != key);  // the default tenant has a scope of its own too
  CHECK(kvrelay::kv_store::tenant_scoped_key(key, "") != acme);
}

TEST_CASE("the kvrelay fields' signature verifies only unchanged fields under the node key",
          "[broker][tenant][security]") {
  json fields{{"agent", "reader"},
              {"tenant", "acme"},
              {"routes", {"a-to-b"}},
              {"request_id", "r1"},
              {"chain_root", kvrelay::block_hash_hex(derive_chain_root(kAcmeSalt, ""))}};
  sign_request_context(fields, kNodeKey);
  REQUIRE(fields[kSignatureField].get<std::string>().size() == 64);
  CHECK(request_signature_valid(fields, kNodeKey));
  // Canonical: a worker that re-serializes the fields in another key order keeps them valid.
  CHECK(request_signature_valid(json::parse(fields.dump(2)), kNodeKey));
  CHECK_FALSE(request_signature_valid(fields, "another-node-key-0123456789"));
  for (const char* field : {"agent", "tenant", "request_id", "chain_root"}) {
    json tampered = fields;
    tampered[field] = "x";
    INFO(field);
    CHECK_FALSE(request_signature_valid(tampered, kNodeKey));
  }
  json added = fields;
  added["treatment"] = {{"name", "T0"}};
  CHECK_FALSE(request_signature_valid(added, kNodeKey));
  json unsigned_fields = fields;
  unsigned_fields.erase(kSignatureField);
  CHECK_FALSE(request_signature_valid(unsigned_fields, kNodeKey));
  json truncated = fields;
  truncated[kSignatureField] = fields[kSignatureField].get<std::string>().substr(0, 63);
  CHECK_FALSE(request_signature_valid(truncated, kNodeKey));
  CHECK_FALSE(request_signature_valid(json::array(), kNodeKey));
}

TEST_CASE("with a node key, unsigned or forged kvrelay fields are read as none", "[broker][tenant][security]") {
  kvrelay::Policy policy;
  json fields{{"agent", "reader"}, {"tenant", "acme"}, {"route", "a-to-b"}};
  // No node key: the fields are taken as they are (policies without tenants).
  const auto trusted_as_is = trusted_request_context(policy, fields.dump());
  REQUIRE(trusted_as_is);
  CHECK(trusted_as_is.value().context.tenant == "acme");
  CHECK(trusted_as_is.value().ignored.empty());

  policy.signing.node_key_file = "/etc/kvrelay/node.key";
  policy.signing.node_key = kNodeKey;
  const auto unsigned_fields = trusted_request_context(policy, fields.dump());
  REQUIRE(unsigned_fields);
  CHECK(unsigned_fields.value().ignored == "unsigned");
  CHECK(unsigned_fields.value().context.agent.empty());
  CHECK(unsigned_fields.value().context.tenant.empty());
  CHECK(unsigned_fields.value().context.route.empty());

  json forged = fields;
  forged[kSignatureField] = std::string(64, '0');
  const auto forged_fields = trusted_request_context(policy, forged.dump());
  REQUIRE(forged_fields);
  CHECK(forged_fields.value().ignored == "forged");
  CHECK(forged_fields.value().context.tenant.empty());

  json signed_fields = fields;
  sign_request_context(signed_fields, kNodeKey);
  const auto verified = trusted_request_context(policy, signed_fields.dump());
  REQUIRE(verified);
  CHECK(verified.value().ignored.empty());
  CHECK(verified.value().context.tenant == "acme");
  CHECK(verified.value().context.route == "a-to-b");

  const auto none = trusted_request_context(policy, "");
  REQUIRE(none);
  CHECK(none.value().ignored.empty());  // no fields at all is not a forgery
}

TEST_CASE("a request context carries its tenant and chain root both ways", "[broker][tenant]") {
  RequestContext context;
  context.agent = "reader";
  context.tenant = "acme";
  context.chain_root = derive_chain_root(kAcmeSalt, "s");
  const auto parsed = parse_request_context(request_context_json(context).dump());
  REQUIRE(parsed);
  CHECK(parsed.value().tenant == "acme");
  CHECK(parsed.value().chain_root == context.chain_root);
  CHECK_FALSE(parse_request_context(R"({"chain_root": "xyz"})"));
  CHECK_FALSE(parse_request_context(R"({"chain_root": 12})"));
  CHECK_FALSE(parse_request_context(R"({"agent": "reader"})").value().chain_root);
}
