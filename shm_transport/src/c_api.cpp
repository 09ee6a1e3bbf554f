// The C ABI over ShmClient. No exception or C++ type crosses this boundary.

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <new>
#include <optional>
#include <string>

#include "kvrelay/core/block_hash.h"
#include "kvrelay/core/model_fingerprint.h"
#include "kvrelay/core/tensor_parallel.h"
#include "kvrelay/shm_transport/client.h"
#include "kvrelay/shm_transport/kvrelay_client.h"

struct kvrelay_client {
  kvrelay::shm::ShmClient client;
  std::string last_error;
};

struct kvrelay_region {
  kvrelay::shm::WritableRegion region;
};

struct kvrelay_entry {
  kvrelay::shm::ReadOnlyEntry entry;
};

namespace {

using kvrelay::Error;
using kvrelay::ErrorCode;

// The C name of every ErrorCode. A code added to core without one here fails the build
// (-Wswitch, warnings are errors), and the static_asserts keep the numbers equal.
constexpr int c_error_code(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kOk:
      return KVRELAY_OK;
    case ErrorCode::kInvalidArgument:
      return KVRELAY_E_INVALID_ARGUMENT;
    case ErrorCode::kOverflow:
      return KVRELAY_E_OVERFLOW;
    case ErrorCode::kOutOfRange:
      return KVRELAY_E_OUT_OF_RANGE;
    case ErrorCode::kTruncated:
      return KVRELAY_E_TRUNCATED;
    case ErrorCode::kBadMagic:
      return KVRELAY_E_BAD_MAGIC;
    case ErrorCode::kBadVersion:
      return KVRELAY_E_BAD_VERSION;
    case ErrorCode::kUnknownCodec:
      return KVRELAY_E_UNKNOWN_CODEC;
    case ErrorCode::kLayoutMismatch:
      return KVRELAY_E_LAYOUT_MISMATCH;
    case ErrorCode::kChecksumMismatch:
      return KVRELAY_E_CHECKSUM_MISMATCH;
    case ErrorCode::kCorrupt:
      return KVRELAY_E_CORRUPT;
    case ErrorCode::kNotFound:
      return KVRELAY_E_NOT_FOUND;
    case ErrorCode::kAlreadyExists:
      return KVRELAY_E_ALREADY_EXISTS;
    case ErrorCode::kPermissionDenied:
      return KVRELAY_E_PERMISSION_DENIED;
    case ErrorCode::kResourceExhausted:
      return KVRELAY_E_RESOURCE_EXHAUSTED;
    case ErrorCode::kTimeout:
      return KVRELAY_E_TIMEOUT;
    case ErrorCode::kIo:
      return KVRELAY_E_IO;
    case ErrorCode::kProtocol:
      return KVRELAY_E_PROTOCOL;
    case ErrorCode::kUnsupported:
      return KVRELAY_E_UNSUPPORTED;
    case ErrorCode::kCancelled:
      return KVRELAY_E_CANCELLED;
    case ErrorCode::kInternal:
      return KVRELAY_E_INTERNAL;
    case ErrorCode::kChainMismatch:
      return KVRELAY_E_CHAIN_MISMATCH;
  }
  return -1;
}

// Every ErrorCode value (the enum is 16 bits wide) that has a C name crosses as its own number.
constexpr bool codes_cross_unchanged() noexcept {
  for (int value = 0; value <= 0xFFFF; ++value) {
    const int c_code = c_error_code(static_cast<ErrorCode>(value));
    if (c_code != -1 && c_code != value) return false;
  }
  return true;
}
static_assert(codes_cross_unchanged(), "a KVRELAY_E_ code differs from its kvrelay::ErrorCode");

static_assert(KVRELAY_ROOT_BLOCK_HASH == kvrelay::kRootBlockHash,
              "KVRELAY_ROOT_BLOCK_HASH differs from kRootBlockHash");

// The C values of kvrelay_client_options.memory_strategy are MemoryStrategy's, in order.
static_assert(KVRELAY_MEMORY_PORTABLE == static_cast<int>(kvrelay::MemoryStrategy::kPortable));
static_assert(KVRELAY_MEMORY_PREFAULT == static_cast<int>(kvrelay::MemoryStrategy::kPrefault));

int record(kvrelay_client* client, const Error& error) {
  if (client != nullptr) client->last_error = error.to_string();
  return c_error_code(error.code);
}

// The C dtype values are the wire's (DType), and the version-3 options end where ABI 6 added a field.
static_assert(KVRELAY_DTYPE_FP32 == static_cast<int>(kvrelay::DType::kFloat32));
static_assert(KVRELAY_DTYPE_FP16 == static_cast<int>(kvrelay::DType::kFloat16));
static_assert(KVRELAY_DTYPE_BF16 == static_cast<int>(kvrelay::DType::kBFloat16));
static_assert(KVRELAY_DTYPE_FP8_E4M3 == static_cast<int>(kvrelay::DType::kFp8E4M3));
static_assert(KVRELAY_DTYPE_FP8_E5M2 == static_cast<int>(kvrelay::DType::kFp8E5M2));
static_assert(offsetof(kvrelay_client_options, reply_timeout_ms) == KVRELAY_CLIENT_OPTIONS_SIZE_V3);

// NULL is the defaults. Both sizes the struct has had are accepted; fields past the caller's
// struct_size keep their defaults.
kvrelay::Result<kvrelay::shm::ShmClientOptions> to_client_options(const kvrelay_client_options* options) {
  kvrelay::shm::ShmClientOptions out;
  if (options == nullptr) return out;
  if (options->struct_size != sizeof(kvrelay_client_options) &&
      options->struct_size != KVRELAY_CLIENT_OPTIONS_SIZE_V3) {
    return kvrelay::fail(ErrorCode::kInvalidArgument,
                         "kvrelay_client_options.struct_size " + std::to_string(options->struct_size) +
                             " is neither sizeof(kvrelay_client_options) = " +
                             std::to_string(sizeof(kvrelay_client_options)) + " nor the version-3 size 8");
  }
  if (options->struct_size >= offsetof(kvrelay_client_options, reply_timeout_ms) + sizeof(uint32_t) &&
      options->reply_timeout_ms != 0) {
    out.reply_timeout = std::chrono::milliseconds(options->reply_timeout_ms);
  }
  switch (options->memory_strategy) {
    case KVRELAY_MEMORY_PORTABLE:
      out.memory_strategy = kvrelay::MemoryStrategy::kPortable;
      break;
    case KVRELAY_MEMORY_PREFAULT:
      out.memory_strategy = kvrelay::MemoryStrategy::kPrefault;
      break;
    default:
      return kvrelay::fail(ErrorCode::kInvalidArgument, "kvrelay_client_options.memory_strategy is unknown");
  }
  return out;
}

int invalid(kvrelay_client* client, const char* what) {
  return record(client, Error{kvrelay::ErrorCode::kInvalidArgument, what});
}

kvrelay::KvLayout to_layout(const kvrelay_layout& layout) {
  kvrelay::KvLayout out;
  out.layers = layout.layers;
  out.kv_heads = layout.kv_heads;
  out.head_dim = layout.head_dim;
  out.dtype = static_cast<kvrelay::DType>(layout.dtype);
  out.tokens = layout.tokens;
  return out;
}

bool valid_dtype(const kvrelay_layout& layout) {
  // Checked at its full width: a value past 255 is no dtype, not its low byte's.
  return layout.layers == 0 ||
         (layout.dtype <= 0xFF && kvrelay::dtype_from_wire(static_cast<std::uint8_t>(layout.dtype)).has_value());
}

// NULL is exact. The codec spec must be NUL-terminated inside its array.
kvrelay::Result<kvrelay::Fidelity> to_fidelity(const kvrelay_fidelity* fidelity) {
  if (fidelity == nullptr) return kvrelay::Fidelity::exact();
  if (fidelity->struct_size != sizeof(kvrelay_fidelity)) {
    return kvrelay::fail(ErrorCode::kInvalidArgument, "kvrelay_fidelity.struct_size is not sizeof(kvrelay_fidelity)");
  }
  if (fidelity->lossy == 0) return kvrelay::Fidelity::exact();
  if (fidelity->lossy != 1) return kvrelay::fail(ErrorCode::kInvalidArgument, "kvrelay_fidelity.lossy is not 0 or 1");
  const std::string_view codec(fidelity->lossy_codec, ::strnlen(fidelity->lossy_codec, sizeof(fidelity->lossy_codec)));
  if (codec.size() == sizeof(fidelity->lossy_codec)) {
    return kvrelay::fail(ErrorCode::kInvalidArgument, "kvrelay_fidelity.lossy_codec is not NUL-terminated");
  }
  if (codec.empty()) return kvrelay::fail(ErrorCode::kInvalidArgument, "lossy kvrelay_fidelity without lossy_codec");
  return kvrelay::Fidelity::lossy(std::string(codec), fidelity->exact_tokens);
}

// NULL is none. The ids are copied: the caller's array need only live during the call.
kvrelay::Result<std::optional<kvrelay::kv_store::EntryChain>> to_chain(const kvrelay_chain* chain) {
  if (chain == nullptr) return std::optional<kvrelay::kv_store::EntryChain>();
  if (chain->struct_size != sizeof(kvrelay_chain)) {
    return kvrelay::fail(ErrorCode::kInvalidArgument, "kvrelay_chain.struct_size is not sizeof(kvrelay_chain)");
  }
  if (chain->block_tokens == 0) return kvrelay::fail(ErrorCode::kInvalidArgument, "kvrelay_chain.block_tokens is 0");
  if (chain->count > kvrelay::kv_store::kMaxChainTokens) {
    return kvrelay::fail(ErrorCode::kResourceExhausted, "kvrelay_chain.count exceeds the most one chain carries");
  }
  if (chain->tokens == nullptr && chain->count != 0) {
    return kvrelay::fail(ErrorCode::kInvalidArgument, "kvrelay_chain.tokens is NULL");
  }
  kvrelay::kv_store::EntryChain out;
  out.block_tokens = chain->block_tokens;
  out.root = chain->root;
  out.tokens.assign(chain->tokens, chain->tokens + chain->count);
  return std::optional(std::move(out));
}

// Calls refuse struct sizes they do not know, naming the struct and the size.
int wrong_size(kvrelay_client* client, const char* name, std::uint32_t size, std::size_t expected) {
  char message[160];
  std::snprintf(message, sizeof(message), "%s.struct_size %u is not sizeof(%s) = %zu", name, size, name, expected);
  return record(client, Error{ErrorCode::kInvalidArgument, message});
}

// The fingerprint of one rank's shard (see kvrelay_model_id).
kvrelay::Result<kvrelay::ModelFingerprint> shard_fingerprint(const kvrelay_model& model) {
  if (model.struct_size != sizeof(kvrelay_model)) {
    return kvrelay::fail(ErrorCode::kInvalidArgument, "kvrelay_model.struct_size " + std::to_string(model.struct_size) +
                                                          " is not sizeof(kvrelay_model)");
  }
  if (model.architecture == nullptr || model.weights == nullptr) {
    return kvrelay::fail(ErrorCode::kInvalidArgument, "kvrelay_model.architecture or .weights is NULL");
  }
  const auto dtype = model.dtype <= 0xFF ? kvrelay::dtype_from_wire(static_cast<std::uint8_t>(model.dtype))
                                         : std::optional<kvrelay::DType>();
  if (!dtype) return kvrelay::fail(ErrorCode::kInvalidArgument, "kvrelay_model.dtype is unknown");
  kvrelay::ModelFingerprint fingerprint{model.architecture, model.layers, model.kv_heads,
                                        model.head_dim,     *dtype,       model.weights};
  if (model.tp_size <= 1) return fingerprint;
  if (model.tp_rank >= model.tp_size)
    return kvrelay::fail(ErrorCode::kInvalidArgument, "kvrelay_model.tp_rank >= tp_size");
  fingerprint.kv_heads = kvrelay::shard_kv_heads(model.kv_heads, model.tp_size);
  if (fingerprint.kv_heads == 0) {
    return kvrelay::fail(ErrorCode::kInvalidArgument, "kvrelay_model.kv_heads is not a multiple of tp_size");
  }
  fingerprint.weights_identity += "#tp" + std::to_string(model.tp_rank) + "/" + std::to_string(model.tp_size);
  return fingerprint;
}

// Restores the client's reply timeout when a call with its own deadline ends.
class CallTimeout {
 public:
  CallTimeout(kvrelay::shm::ShmClient& client, std::uint32_t timeout_ms)
      : client_(client), saved_(client.reply_timeout()) {
    if (timeout_ms != 0) {
      client_.set_reply_timeout(std::chrono::milliseconds(timeout_ms));
      set_ = true;
    }
  }
  ~CallTimeout() {
    if (set_) client_.set_reply_timeout(saved_);
  }
  CallTimeout(const CallTimeout&) = delete;
  CallTimeout& operator=(const CallTimeout&) = delete;

 private:
  kvrelay::shm::ShmClient& client_;
  std::chrono::milliseconds saved_;
  bool set_ = false;
};

// Fills *out (may be NULL) from a Resolve's meta; the caller checked its struct_size.
void fill_resolved(const kvrelay::shm::ResolvedMeta& meta, std::uint64_t block_tokens, std::uint64_t reservation,
                   kvrelay_resolved* out) {
  if (out == nullptr) return;
  out->reserved = 0;
  out->tokens = std::uint64_t{meta.blocks} * block_tokens;
  out->reservation = reservation;
  std::memset(out->medium, 0, sizeof(out->medium));
  std::memcpy(out->medium, meta.medium.data(), std::min(meta.medium.size(), sizeof(out->medium) - 1));
  std::memset(&out->fidelity, 0, sizeof(out->fidelity));
  out->fidelity.struct_size = sizeof(kvrelay_fidelity);
  if (!meta.fidelity.is_exact()) {
    out->fidelity.lossy = 1;
    out->fidelity.exact_tokens = meta.fidelity.exact_tokens;
    std::memcpy(out->fidelity.lossy_codec, meta.fidelity.lossy_codec.data(),
                std::min(meta.fidelity.lossy_codec.size(), sizeof(out->fidelity.lossy_codec) - 1));
  }
}

}  // namespace

extern "C" {

int kvrelay_abi_version(void) {
  return KVRELAY_CLIENT_ABI_VERSION;
}

int kvrelay_client_connect(const char* socket_path, kvrelay_client** out) {
  return kvrelay_client_connect_with_options(socket_path, nullptr, out);
}

int kvrelay_client_connect_with_options(const char* socket_path, const kvrelay_client_options* options,
                                        kvrelay_client** out) {
  if (socket_path == nullptr || out == nullptr) return KVRELAY_E_INVALID_ARGUMENT;
  *out = nullptr;
  const auto parsed = to_client_options(options);
  if (!parsed) return c_error_code(parsed.error().code);
  auto connected = kvrelay::shm::ShmClient::connect(socket_path, parsed.value());
  if (!connected) return c_error_code(connected.error().code);
  auto* client = new (std::nothrow) kvrelay_client{std::move(connected).value(), {}};
  if (client == nullptr) return KVRELAY_E_RESOURCE_EXHAUSTED;
  *out = client;
  return KVRELAY_OK;
}

void kvrelay_client_close(kvrelay_client* client) {
  delete client;
}

const char* kvrelay_last_error(const kvrelay_client* client) {
  return client == nullptr ? "" : client->last_error.c_str();
}

int kvrelay_region_alloc(kvrelay_client* client, uint64_t size, kvrelay_region** out) {
  if (client == nullptr || out == nullptr) return invalid(client, "null argument");
  *out = nullptr;
  auto region = client->client.allocate(size);
  if (!region) return record(client, region.error());
  auto* handle = new (std::nothrow) kvrelay_region{std::move(region).value()};
  if (handle == nullptr) return KVRELAY_E_RESOURCE_EXHAUSTED;
  *out = handle;
  return KVRELAY_OK;
}

void* kvrelay_region_data(kvrelay_region* region) {
  return region == nullptr ? nullptr : region->region.bytes().data();
}

uint64_t kvrelay_region_size(const kvrelay_region* region) {
  return region == nullptr ? 0 : region->region.bytes().size();
}

int kvrelay_region_commit(kvrelay_client* client, kvrelay_region* region, const kvrelay_key* key,
                          const kvrelay_layout* layout) {
  if (client == nullptr || region == nullptr || key == nullptr || layout == nullptr) {
    delete region;
    return invalid(client, "null argument");
  }
  if (!valid_dtype(*layout)) {
    delete region;
    return invalid(client, "unknown dtype");
  }
  auto committed =
      client->client.commit_written(std::move(region->region), {key->model_id, key->context_hash}, to_layout(*layout));
  delete region;
  return committed ? KVRELAY_OK : record(client, committed.error());
}

int kvrelay_region_abort(kvrelay_client* client, kvrelay_region* region) {
  if (client == nullptr || region == nullptr) {
    delete region;
    return invalid(client, "null argument");
  }
  auto aborted = client->client.abort(std::move(region->region));
  delete region;
  return aborted ? KVRELAY_OK : record(client, aborted.error());
}

int kvrelay_publish(kvrelay_client* client, const kvrelay_key* key, const kvrelay_layout* layout, const void* data,
                    uint64_t size) {
  if (client == nullptr || key == nullptr || layout == nullptr || (data == nullptr && size != 0)) {
    return invalid(client, "null argument");
  }
  if (!valid_dtype(*layout)) return invalid(client, "unknown dtype");
  const std::span bytes(static_cast<const std::byte*>(data), static_cast<std::size_t>(size));
  auto published = client->client.publish({key->model_id, key->context_hash}, to_layout(*layout), bytes);
  return published ? KVRELAY_OK : record(client, published.error());
}

int kvrelay_publish_context(kvrelay_client* client, const kvrelay_key* key, const kvrelay_layout* layout,
                            const void* data, uint64_t size, const char* params_json,
                            const kvrelay_fidelity* fidelity) {
  return kvrelay_publish_chain(client, key, layout, data, size, params_json, fidelity, nullptr);
}

int kvrelay_publish_chain(kvrelay_client* client, const kvrelay_key* key, const kvrelay_layout* layout,
                          const void* data, uint64_t size, const char* params_json, const kvrelay_fidelity* fidelity,
                          const kvrelay_chain* chain) {
  if (client == nullptr || key == nullptr || layout == nullptr || (data == nullptr && size != 0)) {
    return invalid(client, "null argument");
  }
  if (!valid_dtype(*layout)) return invalid(client, "unknown dtype");
  auto parsed = to_fidelity(fidelity);
  if (!parsed) return record(client, parsed.error());
  auto entry_chain = to_chain(chain);
  if (!entry_chain) return record(client, entry_chain.error());
  const std::span bytes(static_cast<const std::byte*>(data), static_cast<std::size_t>(size));
  auto published = client->client.publish_with_context({key->model_id, key->context_hash}, to_layout(*layout), bytes,
                                                       params_json == nullptr ? "" : params_json, parsed.value(),
                                                       entry_chain.value() ? &*entry_chain.value() : nullptr);
  return published ? KVRELAY_OK : record(client, published.error());
}

int kvrelay_lookup(kvrelay_client* client, const kvrelay_key* key, kvrelay_entry** out) {
  if (client == nullptr || key == nullptr || out == nullptr) return invalid(client, "null argument");
  *out = nullptr;
  auto entry = client->client.lookup({key->model_id, key->context_hash});
  if (!entry) return record(client, entry.error());
  auto* handle = new (std::nothrow) kvrelay_entry{std::move(entry).value()};
  if (handle == nullptr) return KVRELAY_E_RESOURCE_EXHAUSTED;
  *out = handle;
  return KVRELAY_OK;
}

const void* kvrelay_entry_data(const kvrelay_entry* entry) {
  return entry == nullptr ? nullptr : entry->entry.bytes().data();
}

uint64_t kvrelay_entry_size(const kvrelay_entry* entry) {
  return entry == nullptr ? 0 : entry->entry.info.bytes;
}

void kvrelay_entry_layout(const kvrelay_entry* entry, kvrelay_layout* out) {
  if (entry == nullptr || out == nullptr) return;
  const auto& layout = entry->entry.info.layout;
  *out = kvrelay_layout{layout.layers, layout.kv_heads, layout.head_dim,
                        layout.layers == 0 ? 0U : static_cast<uint32_t>(layout.dtype), layout.tokens};
}

void kvrelay_entry_release(kvrelay_entry* entry) {
  delete entry;
}

int kvrelay_release_leases(kvrelay_client* client) {
  if (client == nullptr) return invalid(client, "null argument");
  auto released = client->client.release_leases();
  return released ? KVRELAY_OK : record(client, released.error());
}

int kvrelay_small_call(kvrelay_client* client, const void* message, size_t size, void* answer, size_t capacity,
                       size_t* answer_size) {
  if (client == nullptr || (message == nullptr && size != 0) || (answer == nullptr && capacity != 0) ||
      answer_size == nullptr) {
    return invalid(client, "null argument");
  }
  auto called = client->client.ring_call(std::span(static_cast<const std::byte*>(message), size),
                                         std::span(static_cast<std::byte*>(answer), capacity));
  if (!called) return record(client, called.error());
  *answer_size = called.value();
  return KVRELAY_OK;
}

int kvrelay_model_id(const kvrelay_model* model, uint64_t* out) {
  if (model == nullptr || out == nullptr) return KVRELAY_E_INVALID_ARGUMENT;
  const auto fingerprint = shard_fingerprint(*model);
  if (!fingerprint) return c_error_code(fingerprint.error().code);
  *out = fingerprint.value().id();
  return KVRELAY_OK;
}

int kvrelay_model_shard_heads(const kvrelay_model* model, uint32_t* out) {
  if (model == nullptr || out == nullptr) return KVRELAY_E_INVALID_ARGUMENT;
  const auto fingerprint = shard_fingerprint(*model);
  if (!fingerprint) return c_error_code(fingerprint.error().code);
  *out = fingerprint.value().kv_heads;
  return KVRELAY_OK;
}

int kvrelay_resolve(kvrelay_client* client, const kvrelay_resolve_request* request, kvrelay_resolved* out,
                    kvrelay_entry** entry) {
  if (client == nullptr || request == nullptr || out == nullptr) return invalid(client, "null argument");
  if (request->struct_size != sizeof(kvrelay_resolve_request))
    return wrong_size(client, "kvrelay_resolve_request", request->struct_size, sizeof(kvrelay_resolve_request));
  if (out->struct_size != sizeof(kvrelay_resolved))
    return wrong_size(client, "kvrelay_resolved", out->struct_size, sizeof(kvrelay_resolved));
  const bool reserve = (request->flags & KVRELAY_RESOLVE_RESERVE) != 0;
  if ((request->flags & ~KVRELAY_RESOLVE_RESERVE) != 0) return invalid(client, "kvrelay_resolve_request.flags unknown");
  if (!reserve && entry == nullptr) return invalid(client, "null entry (required without KVRELAY_RESOLVE_RESERVE)");
  if (entry != nullptr) *entry = nullptr;
  if (request->block_tokens == 0) return invalid(client, "kvrelay_resolve_request.block_tokens is 0");
  if (request->tokens == nullptr && request->count != 0)
    return invalid(client, "kvrelay_resolve_request.tokens is NULL");
  const std::span<const std::uint32_t> tokens(request->tokens, static_cast<std::size_t>(request->count));
  kvrelay::shm::ResolveRequest asked;
  asked.model_id = request->model_id;
  asked.block_tokens = request->block_tokens;
  asked.prompt_tokens = request->count;
  asked.block_hashes = kvrelay::hash_blocks(request->model_id, tokens, request->block_tokens, request->root);
  asked.params_json = request->params_json == nullptr ? "" : request->params_json;
  CallTimeout deadline(client->client, request->timeout_ms);
  if (reserve) {
    auto reserved = client->client.reserve(asked);
    if (!reserved) return record(client, reserved.error());
    fill_resolved(reserved.value().meta, request->block_tokens, reserved.value().id, out);
    return KVRELAY_OK;
  }
  auto resolved = client->client.resolve(asked);
  if (!resolved) return record(client, resolved.error());
  auto* handle = new (std::nothrow) kvrelay_entry{std::move(resolved.value().entry)};
  if (handle == nullptr) return KVRELAY_E_RESOURCE_EXHAUSTED;
  fill_resolved(resolved.value().meta, request->block_tokens, 0, out);
  *entry = handle;
  return KVRELAY_OK;
}

int kvrelay_claim(kvrelay_client* client, uint64_t reservation, uint32_t timeout_ms, kvrelay_resolved* out,
                  kvrelay_entry** entry) {
  if (client == nullptr || entry == nullptr) return invalid(client, "null argument");
  *entry = nullptr;
  if (out != nullptr && out->struct_size != sizeof(kvrelay_resolved))
    return wrong_size(client, "kvrelay_resolved", out->struct_size, sizeof(kvrelay_resolved));
  CallTimeout deadline(client->client, timeout_ms);
  auto claimed = client->client.claim(reservation);
  if (!claimed) return record(client, claimed.error());
  // Tokens from the entry's layout: the claim does not know the block size the reserver used.
  const std::uint64_t block_tokens =
      claimed.value().meta.blocks == 0 ? 0 : claimed.value().entry.info.layout.tokens / claimed.value().meta.blocks;
  auto* handle = new (std::nothrow) kvrelay_entry{std::move(claimed.value().entry)};
  if (handle == nullptr) return KVRELAY_E_RESOURCE_EXHAUSTED;
  fill_resolved(claimed.value().meta, block_tokens, reservation, out);
  *entry = handle;
  return KVRELAY_OK;
}

int kvrelay_release_reservation(kvrelay_client* client, uint64_t reservation) {
  if (client == nullptr) return invalid(client, "null argument");
  auto released = client->client.release_reservation(reservation);
  return released ? KVRELAY_OK : record(client, released.error());
}

int kvrelay_region_commit_request(kvrelay_client* client, kvrelay_region* region,
                                  const kvrelay_publish_request* request, const kvrelay_layout* layout) {
  auto refuse = [&](int code) {
    delete region;
    return code;
  };
  if (client == nullptr || region == nullptr || request == nullptr || layout == nullptr)
    return refuse(invalid(client, "null argument"));
  if (request->struct_size != sizeof(kvrelay_publish_request)) {
    return refuse(wrong_size(client, "kvrelay_publish_request", request->struct_size, sizeof(kvrelay_publish_request)));
  }
  if (!valid_dtype(*layout)) return refuse(invalid(client, "unknown dtype"));
  if (request->block_tokens == 0) return refuse(invalid(client, "kvrelay_publish_request.block_tokens is 0"));
  if (request->tokens == nullptr || request->count == 0)
    return refuse(invalid(client, "kvrelay_publish_request.tokens is NULL or count 0"));
  if (request->count % request->block_tokens != 0)
    return refuse(invalid(client, "kvrelay_publish_request.count is not a whole number of blocks"));
  if (request->count != layout->tokens)
    return refuse(invalid(client, "kvrelay_publish_request.count differs from layout->tokens"));
  if (request->count > request->prompt_tokens)
    return refuse(invalid(client, "kvrelay_publish_request.count exceeds prompt_tokens"));
  auto fidelity = to_fidelity(request->fidelity);
  if (!fidelity) return refuse(record(client, fidelity.error()));
  const kvrelay_chain chain{sizeof(kvrelay_chain), request->block_tokens, request->root, request->tokens,
                            request->count};
  auto entry_chain = to_chain(&chain);
  if (!entry_chain) return refuse(record(client, entry_chain.error()));
  // count <= prompt_tokens: a prompt's KV, every token of it the prompt's (issue #28's boundary).
  entry_chain.value()->prompt_tokens = static_cast<std::uint32_t>(request->count);
  // The key is the chain's last block hash, as the sidecar recomputes it when it verifies.
  const auto hashes =
      kvrelay::kv_store::chain_keys(request->model_id, *entry_chain.value(), kvrelay::kv_store::ChainScope::kUnscoped);
  const kvrelay::kv_store::EntryKey key{request->model_id, hashes.back()};
  auto committed = client->client.commit_written_with_context(
      std::move(region->region), key, to_layout(*layout), request->params_json == nullptr ? "" : request->params_json,
      fidelity.value(), &*entry_chain.value());
  delete region;
  return committed ? KVRELAY_OK : record(client, committed.error());
}

int kvrelay_report_prefill(kvrelay_client* client, const kvrelay_prefill_report* report) {
  if (client == nullptr || report == nullptr) return invalid(client, "null argument");
  if (report->struct_size != sizeof(kvrelay_prefill_report))
    return wrong_size(client, "kvrelay_prefill_report", report->struct_size, sizeof(kvrelay_prefill_report));
  kvrelay::shm::PrefillReport sent{report->model_id, report->computed_tokens, report->context_tokens, report->seconds,
                                   report->params_json == nullptr ? "" : report->params_json};
  auto reported = client->client.report_prefill(sent);
  return reported ? KVRELAY_OK : record(client, reported.error());
}

}  // extern "C"
