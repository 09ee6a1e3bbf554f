#include "kvrelay/codec_plugins/registry.h"

#include <dlfcn.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <iterator>

#include "kvrelay/codec_plugins/builtin_codecs.h"

namespace kvrelay::codec {
namespace {

constexpr std::size_t kMaxNameLength = 31;
// The struct's size in ABI version 1; later minor revisions may only append fields.
constexpr std::uint32_t kMinStructSize = sizeof(kvrelay_codec_plugin);

bool valid_name(const char* name) {
  if (name == nullptr) return false;
  const std::size_t length = strnlen(name, kMaxNameLength + 1);
  if (length == 0 || length > kMaxNameLength) return false;
  return std::all_of(name, name + length,
                     [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-'; });
}

// Every function an implementation must provide (for add and set_executor alike).
bool has_every_function(const kvrelay_codec_plugin& plugin) {
  return plugin.max_encoded_size != nullptr && plugin.encode != nullptr && plugin.decode != nullptr &&
         plugin.error_text != nullptr;
}

}  // namespace

Codec::Codec(const kvrelay_codec_plugin* plugin, std::string origin, std::shared_ptr<void> library)
    : plugin_(plugin), executor_(plugin), origin_(std::move(origin)), library_(std::move(library)) {}

Status CodecRegistry::set_executor(std::uint32_t codec_id, const kvrelay_codec_plugin* executor, std::string device) {
  auto found =
      std::find_if(codecs_.begin(), codecs_.end(), [codec_id](const auto& codec) { return codec->id() == codec_id; });
  if (found == codecs_.end()) return fail(ErrorCode::kNotFound, fmt::format("no codec with id {}", codec_id));
  if (executor == nullptr || executor->codec_id != codec_id || !has_every_function(*executor)) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("not an implementation of codec '{}' (id {})", (*found)->name(), codec_id));
  }
  (*found)->executor_ = executor;
  (*found)->device_ = std::move(device);
  return ok();
}

std::vector<std::uint8_t> Codec::default_params() const {
  const auto* bytes = static_cast<const std::uint8_t*>(plugin_->default_params);
  if (bytes == nullptr) return {};
  return {bytes, bytes + plugin_->default_params_size};
}

std::string Codec::flag_names() const {
  std::string names;
  const auto append = [&names](const char* name) {
    if (!names.empty()) names += ',';
    names += name;
  };
  append(lossless() ? "lossless" : "lossy");
  if ((flags() & KVRELAY_CODEC_FLAG_HOST_MEMORY) != 0) append("host");
  if ((flags() & KVRELAY_CODEC_FLAG_CUDA_DEVICE) != 0) append("cuda");
  if ((flags() & KVRELAY_CODEC_FLAG_POSITION_SPARSE) != 0) append("position-sparse");
  return names;
}

CodecRegistry CodecRegistry::with_builtins() {
  CodecRegistry registry;
  for (const auto* plugin : {raw_codec(), lossless_codec(), fp8_codec(), int8_codec(), int4_codec(), sparse_codec()}) {
    auto added = registry.add(plugin, "built-in");
    if (!added) spdlog::error("built-in codec refused: {}", added.error().to_string());
  }
  return registry;
}

Status CodecRegistry::add(const kvrelay_codec_plugin* plugin, std::string origin, std::shared_ptr<void> library) {
  if (plugin == nullptr) return fail(ErrorCode::kInvalidArgument, fmt::format("{}: entry returned NULL", origin));
  if (plugin->abi_version != KVRELAY_CODEC_ABI_VERSION) {
    return fail(ErrorCode::kBadVersion, fmt::format("{}: codec ABI version {} (this build speaks {})", origin,
                                                    plugin->abi_version, KVRELAY_CODEC_ABI_VERSION));
  }
  if (plugin->struct_size < kMinStructSize) {
    return fail(ErrorCode::kLayoutMismatch, fmt::format("{}: codec struct is {} bytes, expected at least {}", origin,
                                                        plugin->struct_size, kMinStructSize));
  }
  if (!valid_name(plugin->name)) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("{}: codec name missing or not [a-z0-9_-]{{1,31}}", origin));
  }
  if (!has_every_function(*plugin)) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("{}: codec '{}' lacks a function pointer", origin, plugin->name));
  }
  if (plugin->default_params_size > 0 && plugin->default_params == nullptr) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("{}: codec '{}' default params NULL", origin, plugin->name));
  }
  if (!library && plugin->codec_id >= KVRELAY_CODEC_FIRST_PLUGIN_ID) {
    // Built-ins only below the plugin range; the check below covers the opposite direction.
  } else if (library && plugin->codec_id < KVRELAY_CODEC_FIRST_PLUGIN_ID) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("{}: plugin codec id {} is in the built-in range (< {})",
                                                         origin, plugin->codec_id, KVRELAY_CODEC_FIRST_PLUGIN_ID));
  }
  if (const Codec* existing = find(std::string_view(plugin->name))) {
    return fail(ErrorCode::kAlreadyExists,
                fmt::format("{}: codec name '{}' already registered by {}", origin, plugin->name, existing->origin()));
  }
  if (const Codec* existing = find(plugin->codec_id)) {
    return fail(ErrorCode::kAlreadyExists, fmt::format("{}: codec id {} already used by '{}' ({})", origin,
                                                       plugin->codec_id, existing->name(), existing->origin()));
  }
  codecs_.push_back(std::make_unique<Codec>(plugin, std::move(origin), std::move(library)));
  return ok();
}

Status CodecRegistry::load_file(const std::filesystem::path& path) {
  dlerror();
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* reason = dlerror();
    return fail(ErrorCode::kIo, fmt::format("{}: dlopen failed: {}", path.string(), reason ? reason : "unknown"));
  }
  std::shared_ptr<void> library(handle, [](void* opened) { dlclose(opened); });
  dlerror();
  void* symbol = dlsym(handle, KVRELAY_CODEC_ENTRY_SYMBOL);
  if (symbol == nullptr) {
    const char* reason = dlerror();
    return fail(ErrorCode::kNotFound, fmt::format("{}: no symbol {}: {}", path.string(), KVRELAY_CODEC_ENTRY_SYMBOL,
                                                  reason ? reason : "null"));
  }
  kvrelay_codec_entry_fn entry;
  static_assert(sizeof(entry) == sizeof(symbol));
  std::memcpy(&entry, &symbol, sizeof entry);  // POSIX guarantees object/function pointer round trips
  return add(entry(), path.string(), std::move(library));
}

std::vector<PluginLoadFailure> CodecRegistry::load_directory(const std::filesystem::path& directory) {
  std::vector<PluginLoadFailure> failures;
  std::error_code error;
  std::vector<std::filesystem::path> files;
  for (std::filesystem::directory_iterator it(directory, error), end; !error && it != end; it.increment(error)) {
    if (it->is_regular_file(error) && it->path().extension() == ".so") files.push_back(it->path());
  }
  if (error) {
    failures.push_back({directory, Error{ErrorCode::kIo, fmt::format("{}: {}", directory.string(), error.message())}});
    spdlog::warn("codec plugins: cannot list {}: {}", directory.string(), error.message());
    return failures;
  }
  std::sort(files.begin(), files.end());
  for (const auto& file : files) {
    auto loaded = load_file(file);
    if (loaded) {
      spdlog::info("codec plugin loaded: {} ({})", codecs_.back()->name(), file.string());
    } else {
      spdlog::warn("codec plugin refused: {}", loaded.error().to_string());
      failures.push_back({file, loaded.error()});
    }
  }
  return failures;
}

std::vector<PluginLoadFailure> CodecRegistry::load_directories(std::span<const std::string> directories) {
  std::vector<PluginLoadFailure> failures;
  for (const auto& directory : directories) {
    auto refused = load_directory(directory);
    failures.insert(failures.end(), std::make_move_iterator(refused.begin()), std::make_move_iterator(refused.end()));
  }
  return failures;
}

const Codec* CodecRegistry::find(std::string_view name) const {
  for (const auto& codec : codecs_) {
    if (codec->name() == name) return codec.get();
  }
  return nullptr;
}

const Codec* CodecRegistry::find(std::uint32_t id) const {
  for (const auto& codec : codecs_) {
    if (codec->id() == id) return codec.get();
  }
  return nullptr;
}

namespace {
constexpr std::string_view kZstdSuffix = "+zstd";
}  // namespace

Result<CodecSpec> resolve_codec(const CodecRegistry& registry, std::string_view spec) {
  CodecSpec resolved;
  std::string_view name = spec;
  if (name.size() > kZstdSuffix.size() && name.ends_with(kZstdSuffix)) {
    resolved.zstd_stage = true;
    name.remove_suffix(kZstdSuffix.size());
  }
  resolved.codec = registry.find(name);
  if (resolved.codec == nullptr) return fail(ErrorCode::kUnknownCodec, fmt::format("unknown codec '{}'", spec));
  return resolved;
}

std::string spec_name(const CodecSpec& spec) {
  std::string name(spec.codec != nullptr ? spec.codec->name() : std::string_view("unknown"));
  if (spec.zstd_stage) name += kZstdSuffix;
  return name;
}

Fidelity fidelity_of(const CodecSpec& spec) {
  if (spec.codec != nullptr && spec.codec->lossless()) return Fidelity::exact();
  return Fidelity::lossy(spec_name(spec));
}

Fidelity fidelity_of(const CodecRegistry& registry, std::string_view spec) {
  auto resolved = resolve_codec(registry, spec);
  if (!resolved) return Fidelity::lossy(std::string(spec));
  return fidelity_of(resolved.value());
}

}  // namespace kvrelay::codec
