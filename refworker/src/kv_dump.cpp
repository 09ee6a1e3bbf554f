#include "kvrelay/refworker/kv_dump.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>
#include <fstream>

namespace kvrelay::refworker {

namespace {

Status write_bytes(const std::filesystem::path& path, const void* data, std::size_t size) {
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) return fail(ErrorCode::kIo, fmt::format("cannot create {}: {}", path.string(), std::strerror(errno)));
  const bool written = size == 0 || std::fwrite(data, 1, size, file) == size;
  const bool closed = std::fclose(file) == 0;
  if (!written || !closed) return fail(ErrorCode::kIo, fmt::format("cannot write {}", path.string()));
  return ok();
}

}  // namespace

Result<KvDump> dump_kv(const Model& model, std::span<const std::int32_t> tokens, std::uint32_t query_positions) {
  InferenceSession session(model);
  KvDump dump;
  dump.queries.positions = query_positions;
  KVRELAY_TRY(session.prefill(tokens, query_positions > 0 ? &dump.queries : nullptr));
  KVRELAY_TRY(dump.kv, session.export_kv(tokens.size()));
  dump.layout = session.layout(tokens.size());
  return dump;
}

Status write_kv_dump(const KvDump& dump, const Model& model, std::span<const std::int32_t> tokens,
                     const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return fail(ErrorCode::kIo, fmt::format("cannot create {}: {}", dir.string(), ec.message()));
  KVRELAY_TRY(write_bytes(dir / "kv.bin", dump.kv.data(), dump.kv.size() * sizeof(float)));
  KVRELAY_TRY(write_bytes(dir / "queries.bin", dump.queries.data.data(), dump.queries.data.size() * sizeof(float)));
  const auto& config = model.config();
  const auto& fingerprint = model.fingerprint();
  nlohmann::json layout = {
      {"layers", dump.layout.layers},
      {"kv_heads", dump.layout.kv_heads},
      {"head_dim", dump.layout.head_dim},
      {"dtype", std::string(dtype_name(dump.layout.dtype))},
      {"tokens", dump.layout.tokens},
      {"kv_order", "per layer K then V, each [tokens, kv_heads, head_dim], K after RoPE"},
      {"kv_bytes", dump.kv.size() * sizeof(float)},
      {"queries", {{"shape", {config.layers, dump.queries.positions, config.heads, config.head_dim()}},
                   {"order", "[layers, positions, heads, head_dim], after RoPE"},
                   {"first_position", tokens.size() - dump.queries.positions}}},
      {"heads", config.heads},
      {"model", {{"shape", config.shape_string()},
                 {"weights_identity", fingerprint.weights_identity},
                 {"fingerprint_id", fmt::format("{:016x}", fingerprint.id())}}},
      {"token_ids", std::vector<std::int32_t>(tokens.begin(), tokens.end())},
  };
  const std::string text = layout.dump(2) + "\n";
  return write_bytes(dir / "layout.json", text.data(), text.size());
}

}  // namespace kvrelay::refworker
