// The C ABI over ShmClient. No exception or C++ type crosses this boundary.

#include <cstring>
#include <new>
#include <string>

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

int record(kvrelay_client* client, const Error& error) {
  if (client != nullptr) client->last_error = error.to_string();
  return static_cast<int>(error.code);
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
  return layout.layers == 0 || kvrelay::dtype_from_wire(static_cast<std::uint8_t>(layout.dtype)).has_value();
}

// NULL is exact. The codec spec must be NUL-terminated inside its array.
kvrelay::Result<kvrelay::Fidelity> to_fidelity(const kvrelay_fidelity* fidelity) {
  using kvrelay::ErrorCode;
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

}  // namespace

extern "C" {

int kvrelay_abi_version(void) {
  return KVRELAY_CLIENT_ABI_VERSION;
}

int kvrelay_client_connect(const char* socket_path, kvrelay_client** out) {
  if (socket_path == nullptr || out == nullptr) return KVRELAY_E_INVALID_ARGUMENT;
  *out = nullptr;
  auto connected = kvrelay::shm::ShmClient::connect(socket_path);
  if (!connected) return static_cast<int>(connected.error().code);
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
  if (client == nullptr || key == nullptr || layout == nullptr || (data == nullptr && size != 0)) {
    return invalid(client, "null argument");
  }
  if (!valid_dtype(*layout)) return invalid(client, "unknown dtype");
  auto parsed = to_fidelity(fidelity);
  if (!parsed) return record(client, parsed.error());
  const std::span bytes(static_cast<const std::byte*>(data), static_cast<std::size_t>(size));
  auto published = client->client.publish_with_context({key->model_id, key->context_hash}, to_layout(*layout), bytes,
                                                       params_json == nullptr ? "" : params_json, parsed.value());
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

}  // extern "C"
