#pragma once

// Every codec the process can use: the built-ins plus plugins loaded from directories. A plugin
// that fails any check is logged and skipped; loading never aborts the daemon.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvrelay/codec_plugins/codec_abi.h"
#include "kvrelay/core/fidelity.h"
#include "kvrelay/core/result.h"

namespace kvrelay::codec {

class Codec {
 public:
  Codec(const kvrelay_codec_plugin* plugin, std::string origin, std::shared_ptr<void> library);

  [[nodiscard]] const kvrelay_codec_plugin& plugin() const { return *plugin_; }
  [[nodiscard]] std::string_view name() const { return plugin_->name; }
  [[nodiscard]] std::uint32_t id() const { return plugin_->codec_id; }
  [[nodiscard]] std::uint32_t flags() const { return plugin_->flags; }
  [[nodiscard]] bool lossless() const { return (plugin_->flags & KVRELAY_CODEC_FLAG_LOSSLESS) != 0; }
  // "built-in" or the shared object's path.
  [[nodiscard]] const std::string& origin() const { return origin_; }
  [[nodiscard]] std::vector<std::uint8_t> default_params() const;
  // "lossless,host" style list of flag names.
  [[nodiscard]] std::string flag_names() const;
  // The implementation encode_frame and decode_frame run for this codec (same id, same bytes):
  // the codec's own unless CodecRegistry::set_executor placed it elsewhere, e.g. on the GPU.
  [[nodiscard]] const kvrelay_codec_plugin& executor() const { return *executor_; }
  // Where executor() runs: "cpu" or "cuda".
  [[nodiscard]] const std::string& device() const { return device_; }

 private:
  friend class CodecRegistry;
  const kvrelay_codec_plugin* plugin_;
  const kvrelay_codec_plugin* executor_;
  std::string device_ = "cpu";
  std::string origin_;
  std::shared_ptr<void> library_;  // keeps the dlopen handle alive as long as the codec
};

struct PluginLoadFailure {
  std::filesystem::path path;
  Error error;
};

class CodecRegistry {
 public:
  CodecRegistry() = default;
  // A registry holding the built-in codecs.
  [[nodiscard]] static CodecRegistry with_builtins();

  // Checks version, size, name and id; refuses a name or id already present.
  Status add(const kvrelay_codec_plugin* plugin, std::string origin, std::shared_ptr<void> library = {});
  // dlopens one shared object and adds the codec it exports.
  Status load_file(const std::filesystem::path& path);
  // Loads every regular `*.so` file in `directory` (sorted by name); failures are logged and returned.
  std::vector<PluginLoadFailure> load_directory(const std::filesystem::path& directory);
  // load_directory of each of `directories` in order (a policy's codecs.plugin_dirs).
  std::vector<PluginLoadFailure> load_directories(std::span<const std::string> directories);

  // Has `executor` (an implementation of the same codec id, e.g. cuda_implementation()) run every
  // later encode and decode of that codec; `device` names where it runs. Set up before sharing
  // the registry between threads.
  Status set_executor(std::uint32_t codec_id, const kvrelay_codec_plugin* executor, std::string device);

  [[nodiscard]] const Codec* find(std::string_view name) const;
  [[nodiscard]] const Codec* find(std::uint32_t id) const;
  [[nodiscard]] const std::vector<std::unique_ptr<Codec>>& codecs() const { return codecs_; }

 private:
  std::vector<std::unique_ptr<Codec>> codecs_;
};

// A codec choice as users write it: "int4", "int4+zstd" (the quantizer followed by the zstd stage).
struct CodecSpec {
  const Codec* codec = nullptr;
  bool zstd_stage = false;
};
[[nodiscard]] Result<CodecSpec> resolve_codec(const CodecRegistry& registry, std::string_view spec);
// The spec text resolve_codec reads back: "int4", "int4+zstd" ("unknown" without a codec).
[[nodiscard]] std::string spec_name(const CodecSpec& spec);
// What KV that went through `spec` is: exact for lossless codecs, else lossy from token 0.
[[nodiscard]] Fidelity fidelity_of(const CodecSpec& spec);
// The same for a spec by name; an unknown spec counts as lossy (nothing unknown is called exact).
[[nodiscard]] Fidelity fidelity_of(const CodecRegistry& registry, std::string_view spec);

}  // namespace kvrelay::codec
