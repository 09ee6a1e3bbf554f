#include "kvrelay/core/model_fingerprint.h"

#include <xxhash.h>

#include <catch2/catch.hpp>

#include <cstring>
#include <string>
#include <vector>

using kvrelay::DType;
using kvrelay::ModelFingerprint;

namespace {

ModelFingerprint stories() {
  return {"llama", 5, 4, 8, DType::kFloat32, "stories260K"};
}

// The documented canonical encoding (docs/wire-format.md), rebuilt here byte by byte.
std::uint64_t reference_id(const ModelFingerprint& fp) {
  std::vector<unsigned char> bytes;
  auto put32 = [&](std::uint32_t v) {
    for (int shift = 0; shift < 32; shift += 8)
      bytes.push_back(static_cast<unsigned char>(v >> shift));
  };
  auto put_string = [&](const std::string& s) {
    put32(static_cast<std::uint32_t>(s.size()));
    bytes.insert(bytes.end(), s.begin(), s.end());
  };
  put32(1);
  put_string(fp.architecture);
  put32(fp.layers);
  put32(fp.kv_heads);
  put32(fp.head_dim);
  bytes.push_back(static_cast<unsigned char>(fp.dtype));
  put_string(fp.weights_identity);
  return XXH3_64bits(bytes.data(), bytes.size());
}

}  // namespace

TEST_CASE("fingerprint id follows the documented canonical encoding", "[core][fingerprint]") {
  CHECK(stories().id() == reference_id(stories()));
  const ModelFingerprint big{"llama", 32, 8, 128, DType::kBFloat16, "llama-3.1-8b-instruct"};
  CHECK(big.id() == reference_id(big));
}

TEST_CASE("fingerprint id is stable across releases (fixed vector)", "[core][fingerprint]") {
  // Changing this value breaks KV exchange with every deployed sidecar: bump the encoding
  // version inside ModelFingerprint::id() instead.
  CHECK(stories().id() == 0xafda8c8e8babfaf7ULL);
}

TEST_CASE("every field changes the fingerprint", "[core][fingerprint]") {
  const auto base = stories();
  std::vector<ModelFingerprint> variants(6, base);
  variants[0].architecture = "mistral";
  variants[1].layers = 6;
  variants[2].kv_heads = 8;
  variants[3].head_dim = 16;
  variants[4].dtype = DType::kFloat16;
  variants[5].weights_identity = "stories260K-finetuned";
  for (const auto& variant : variants) {
    CHECK(variant.id() != base.id());
    CHECK_FALSE(variant.kv_compatible_with(base));
  }
  CHECK(base.kv_compatible_with(stories()));
  // Length prefixes keep field boundaries unambiguous.
  ModelFingerprint shifted_a = base;
  ModelFingerprint shifted_b = base;
  shifted_a.architecture = "llamax";
  shifted_a.weights_identity = "y";
  shifted_b.architecture = "llama";
  shifted_b.weights_identity = "xy";
  CHECK(shifted_a.id() != shifted_b.id());
}

TEST_CASE("fingerprint yields its KV layout", "[core][fingerprint]") {
  const auto layout = stories().layout(17);
  CHECK(layout.layers == 5);
  CHECK(layout.kv_heads == 4);
  CHECK(layout.head_dim == 8);
  CHECK(layout.tokens == 17);
  CHECK(layout.bytes_per_token().value() == 1280);
}
