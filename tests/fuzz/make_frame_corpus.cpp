// Writes the seed corpus for fuzz_frame_decode: small valid frames of every built-in codec,
// dtype and the zstd stage, plus truncated, bit-flipped and resealed-but-inconsistent frames.
// Usage: make_frame_corpus OUTPUT_DIR

#include <xxhash.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "kvrelay/codec_plugins/builtin_params.h"
#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/metrics.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/codec_plugins/tensor_file.h"

using namespace kvrelay;
using namespace kvrelay::codec;

namespace {

void reseal(std::vector<std::uint8_t>& frame) {
  const std::size_t body = frame.size() - kFrameTrailerSize;
  const std::uint64_t checksum = XXH3_64bits(frame.data(), body);
  std::memcpy(frame.data() + body, &checksum, 8);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_frame_corpus OUTPUT_DIR\n");
    return 2;
  }
  const std::filesystem::path out = argv[1];
  std::filesystem::create_directories(out);
  const auto registry = CodecRegistry::with_builtins();
  int index = 0;
  const auto save = [&](const std::string& name, const std::vector<std::uint8_t>& bytes) {
    char prefix[16];
    std::snprintf(prefix, sizeof prefix, "%03d-", index++);
    if (!write_binary_file(out / (prefix + name), bytes)) std::exit(1);
  };
  for (const char* spec_name : {"raw", "lossless", "fp8", "int8", "int4", "sparse", "int4+zstd"}) {
    const auto spec = resolve_codec(registry, spec_name).value();
    for (const char* dtype : {"fp32", "fp16", "bf16"}) {
      // 7 tokens with 2 sinks and 2 recent: every codec section is non-empty.
      const auto layout = parse_layout_spec(std::string("2,2,4,") + dtype, 7).value();
      const auto kv = synthetic_kv(layout, 1).value();
      EncodeOptions options;
      options.zstd_stage = spec.zstd_stage;
      if (spec.codec->id() < KVRELAY_CODEC_FIRST_PLUGIN_ID && spec.codec->default_params().size() == 20) {
        auto params = BuiltinParams::parse(spec.codec->default_params().data(), 20).value();
        params.sink_tokens = 2;
        params.recent_tokens = 2;
        params.group_size = 2;
        const auto wire = params.serialize();
        options.params.assign(wire.begin(), wire.end());
      }
      const auto frame = encode_frame(*spec.codec, layout, kv, options).value();
      const std::string base = std::string(spec_name) + "-" + dtype;
      save(base + "-valid", frame);
      if (std::string(dtype) != "fp16") continue;
      save(base + "-truncated", std::vector<std::uint8_t>(frame.begin(), frame.end() - 9));
      auto flipped = frame;
      flipped[frame.size() / 2] ^= 0x04;
      save(base + "-bitflip", flipped);
      auto short_payload = flipped;
      reseal(short_payload);
      save(base + "-resealed-flip", short_payload);
    }
  }
  save("empty", {});
  save("magic-only", {'K', 'V', 'R', 'F'});
  return 0;
}
