// Reads llama2.c "legacy" checkpoints: seven little-endian int32 (dim, hidden_dim, n_layers,
// n_heads, n_kv_heads, vocab_size, seq_len), then fp32 weights. Everything about the file is
// untrusted: the header is range-checked before any size is derived from it and the file must
// be exactly as long as the header says.

#include <xxhash.h>
#include <fmt/format.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>

#include "kvrelay/refworker/model.h"

namespace kvrelay::refworker {

namespace {

static_assert(std::endian::native == std::endian::little, "llama2.c checkpoints are little-endian");

constexpr std::size_t kHeaderInts = 7;
constexpr std::uint64_t kHeaderBytes = kHeaderInts * sizeof(std::int32_t);

struct FileCloser {
  void operator()(std::FILE* file) const { std::fclose(file); }
};

Result<ModelConfig> config_from_header(const std::array<std::int32_t, kHeaderInts>& header) {
  const char* names[kHeaderInts] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
  for (std::size_t i = 0; i < kHeaderInts; ++i) {
    if (header[i] == 0 || (header[i] < 0 && i != 5) || header[i] == INT32_MIN) {
      return fail(ErrorCode::kCorrupt, fmt::format("checkpoint header field {} = {} is invalid", names[i], header[i]));
    }
  }
  ModelConfig config;
  config.dim = static_cast<std::uint32_t>(header[0]);
  config.hidden_dim = static_cast<std::uint32_t>(header[1]);
  config.layers = static_cast<std::uint32_t>(header[2]);
  config.heads = static_cast<std::uint32_t>(header[3]);
  config.kv_heads = static_cast<std::uint32_t>(header[4]);
  config.shared_classifier = header[5] > 0;
  config.vocab_size = static_cast<std::uint32_t>(header[5] > 0 ? header[5] : -header[5]);
  config.seq_len = static_cast<std::uint32_t>(header[6]);
  if (auto valid = config.validate(); !valid) {
    return fail(ErrorCode::kCorrupt, "checkpoint header: " + valid.error().message);
  }
  return config;
}

}  // namespace

Result<Model> load_llama2c(const std::filesystem::path& path) {
  std::unique_ptr<std::FILE, FileCloser> file(std::fopen(path.c_str(), "rb"));
  if (!file) {
    return fail(ErrorCode::kIo, fmt::format("cannot open checkpoint {}: {}", path.string(), std::strerror(errno)));
  }
  std::error_code size_error;
  const std::uint64_t file_size = std::filesystem::file_size(path, size_error);
  if (size_error) {
    return fail(ErrorCode::kIo, fmt::format("cannot stat checkpoint {}: {}", path.string(), size_error.message()));
  }
  std::array<std::int32_t, kHeaderInts> header{};
  if (file_size < kHeaderBytes || std::fread(header.data(), sizeof(std::int32_t), kHeaderInts, file.get()) != kHeaderInts) {
    return fail(ErrorCode::kTruncated,
                fmt::format("checkpoint {} has {} bytes, shorter than the {}-byte header", path.string(), file_size,
                            kHeaderBytes));
  }
  KVRELAY_TRY(const ModelConfig config, config_from_header(header));
  KVRELAY_TRY(const std::uint64_t floats, llama2c_float_count(config, true));
  KVRELAY_TRY(const std::uint64_t body_bytes, checked_mul(floats, sizeof(float)));
  KVRELAY_TRY(const std::uint64_t expected, checked_add(body_bytes, kHeaderBytes));
  if (file_size < expected) {
    return fail(ErrorCode::kTruncated, fmt::format("checkpoint {} is truncated: {} bytes, shape {} needs {}",
                                                   path.string(), file_size, config.shape_string(), expected));
  }
  if (file_size > expected) {
    return fail(ErrorCode::kCorrupt, fmt::format("checkpoint {} has {} trailing bytes beyond the {} that shape {} needs",
                                                 path.string(), file_size - expected, expected, config.shape_string()));
  }
  std::vector<float> storage;
  try {
    storage.resize(floats);
  } catch (const std::bad_alloc&) {
    return fail(ErrorCode::kResourceExhausted,
                fmt::format("checkpoint {} needs {} bytes of memory; cannot allocate them", path.string(), body_bytes));
  }
  if (std::fread(storage.data(), sizeof(float), storage.size(), file.get()) != storage.size()) {
    return fail(ErrorCode::kIo, fmt::format("short read from checkpoint {}", path.string()));
  }
  for (std::size_t i = 0; i < storage.size(); ++i) {
    if (!std::isfinite(storage[i])) {
      return fail(ErrorCode::kCorrupt,
                  fmt::format("checkpoint {} weight #{} is not finite ({})", path.string(), i, storage[i]));
    }
  }
  // Identity of the exact bytes, so two workers agree on KV compatibility only for the same file.
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) return fail(ErrorCode::kResourceExhausted, "xxh3 state allocation failed");
  XXH3_64bits_reset(state);
  XXH3_64bits_update(state, header.data(), kHeaderBytes);
  XXH3_64bits_update(state, storage.data(), storage.size() * sizeof(float));
  const std::uint64_t digest = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return Model::from_storage(config, std::move(storage), true, fmt::format("{:016x}", digest));
}

}  // namespace kvrelay::refworker
