#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

#include "kvrelay/core/kv_layout.h"
#include "kvrelay/core/result.h"
#include "kvrelay/refworker/model.h"
#include "kvrelay/refworker/session.h"

namespace kvrelay::refworker {

// A prompt's real KV and the queries that would attend to it: what codec quality evaluation
// needs to measure attention-output error rather than raw reconstruction error.
struct KvDump {
  KvLayout layout;
  std::vector<float> kv;  // KvLayout order
  QueryCapture queries;   // [layers, positions, heads, head_dim]
};

// Prefills `tokens` in one pass and returns their KV and the queries of the last `query_positions`.
[[nodiscard]] Result<KvDump> dump_kv(const Model& model, std::span<const std::int32_t> tokens,
                                     std::uint32_t query_positions);

// Writes kv.bin, queries.bin and layout.json (shapes, dtype, fingerprint, tokens) into `dir`.
[[nodiscard]] Status write_kv_dump(const KvDump& dump, const Model& model, std::span<const std::int32_t> tokens,
                                   const std::filesystem::path& dir);

}  // namespace kvrelay::refworker
