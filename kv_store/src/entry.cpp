#include "kvrelay/kv_store/entry.h"

#include <fcntl.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

#include "kvrelay/core/bulk_hash.h"
#include "kvrelay/kv_store/memfd.h"

namespace kvrelay::kv_store {

Status validate_entry_info(const EntryInfo& info) {
  if (info.layout.layers == 0) {
    if (info.layout.kv_heads != 0 || info.layout.head_dim != 0 || info.layout.tokens != 0) {
      return fail(ErrorCode::kLayoutMismatch, "opaque entry (0 layers) with nonzero shape fields");
    }
    return ok();
  }
  KVRELAY_TRY(info.layout.validate());
  KVRELAY_TRY(const auto total, info.layout.total_bytes());
  if (total != info.bytes) {
    return fail(ErrorCode::kLayoutMismatch,
                fmt::format("layout {} needs {} bytes, entry has {}", info.layout.describe(), total, info.bytes));
  }
  return ok();
}

Result<std::shared_ptr<StoredEntry>> make_stored_entry(const KvLayout& layout, std::span<const std::byte> bytes,
                                                       ShmArena* arena) {
  EntryInfo info{layout, bytes.size(), 0};
  KVRELAY_TRY(validate_entry_info(info));
  if (arena != nullptr) {
    if (auto block = arena->allocate(bytes.size())) {
      info.checksum = bulk_copy_hash64(block.value()->bytes().data(), bytes.data(), bytes.size());
      auto entry = std::make_shared<StoredEntry>();
      entry->info = info;
      entry->block = std::move(block).value();
      return entry;
    }
  }
  info.checksum = bulk_hash64(bytes.data(), bytes.size());
  // Filled through the kernel, never mapped here: no first-touch page faults, and nothing
  // writable mapped when F_SEAL_WRITE goes on.
  KVRELAY_TRY(auto fd, create_sealed_memfd_to_fill("kvrelay-entry", bytes.size()));
  KVRELAY_TRY(write_memfd(fd.get(), 0, bytes));
  KVRELAY_TRY(seal_contents(fd.get()));
  auto entry = std::make_shared<StoredEntry>();
  entry->info = info;
  entry->fd = std::move(fd);
  return entry;
}

std::string_view entry_origin_name(EntryOrigin origin) noexcept {
  switch (origin) {
    case EntryOrigin::kPublished:
      return "published";
    case EntryOrigin::kFetched:
      return "fetched";
    case EntryOrigin::kPushed:
      return "pushed";
    case EntryOrigin::kPrefetched:
      return "prefetched";
    case EntryOrigin::kSpilledIn:
      return "spilled_in";
  }
  return "published";
}

Result<std::shared_ptr<StoredEntry>> share_entry(const StoredEntry& entry) {
  auto shared = std::make_shared<StoredEntry>();
  shared->info = entry.info;
  shared->fidelity = entry.fidelity;
  shared->chain = entry.chain;
  shared->origin = entry.origin;
  shared->spilled_from = entry.spilled_from;
  shared->block = entry.block;
  if (!entry.block) {
    const int copy = ::fcntl(entry.fd.get(), F_DUPFD_CLOEXEC, 0);
    if (copy < 0)
      return fail(ErrorCode::kIo, fmt::format("cannot duplicate an entry's memfd: {}", std::strerror(errno)));
    shared->fd = UniqueFd(copy);
  }
  return shared;
}

Result<EntryView> view_entry(const StoredEntry& entry) {
  EntryView view;
  if (entry.block) {
    view.block_ = entry.block;
    view.view_ = entry.block->bytes();
    return view;
  }
  KVRELAY_TRY(view.mapping_, Mapping::map(entry.fd.get(), entry.info.bytes, false));
  view.view_ = view.mapping_.bytes();
  return view;
}

Status read_entry(const StoredEntry& entry, std::uint64_t offset, std::span<std::byte> out) {
  if (offset > entry.info.bytes || out.size() > entry.info.bytes - offset) {
    return fail(ErrorCode::kOutOfRange,
                fmt::format("read of {} bytes at {} from a {}-byte entry", out.size(), offset, entry.info.bytes));
  }
  if (entry.block) {
    if (!out.empty()) std::memcpy(out.data(), entry.block->bytes().data() + offset, out.size());
    return ok();
  }
  return read_memfd(entry.fd.get(), offset, out);
}

void encode_key(ByteWriter& writer, const EntryKey& key) {
  writer.put(key.model_id).put(key.context_hash);
}

std::optional<EntryKey> decode_key(ByteReader& reader) {
  const auto model = reader.get<std::uint64_t>();
  const auto context = reader.get<std::uint64_t>();
  if (!model || !context) return std::nullopt;
  return EntryKey{*model, *context};
}

void encode_layout(ByteWriter& writer, const KvLayout& layout) {
  writer.put(layout.layers).put(layout.kv_heads).put(layout.head_dim);
  writer.put(static_cast<std::uint8_t>(layout.layers == 0 ? 0 : static_cast<std::uint8_t>(layout.dtype)));
  writer.put(std::uint8_t{0}).put(std::uint16_t{0});
  writer.put(layout.tokens);
}

Result<KvLayout> decode_layout(ByteReader& reader) {
  const auto layers = reader.get<std::uint32_t>();
  const auto heads = reader.get<std::uint32_t>();
  const auto dim = reader.get<std::uint32_t>();
  const auto dtype = reader.get<std::uint8_t>();
  const auto pad1 = reader.get<std::uint8_t>();
  const auto pad2 = reader.get<std::uint16_t>();
  const auto tokens = reader.get<std::uint64_t>();
  if (!tokens) return fail(ErrorCode::kTruncated, "layout truncated");
  if (*pad1 != 0 || *pad2 != 0) return fail(ErrorCode::kProtocol, "layout padding must be zero");
  KvLayout layout;
  layout.layers = *layers;
  layout.kv_heads = *heads;
  layout.head_dim = *dim;
  layout.tokens = *tokens;
  if (*layers == 0) {
    if (*dtype != 0) return fail(ErrorCode::kProtocol, "opaque entry with a dtype");
    return layout;
  }
  const auto parsed = dtype_from_wire(*dtype);
  if (!parsed) return fail(ErrorCode::kProtocol, fmt::format("unknown dtype {}", *dtype));
  layout.dtype = *parsed;
  return layout;
}

}  // namespace kvrelay::kv_store
