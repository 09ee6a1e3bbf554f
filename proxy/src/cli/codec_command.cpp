// `kvrelay codec list|encode|decode|eval`: offline access to the codec layer, so KV dumps can be
// compressed, any frame checked and a codec's quality measured from the command line.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/codec_plugins/builtin_params.h"
#include "kvrelay/codec_plugins/device_codecs.h"
#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/metrics.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/codec_plugins/tensor_file.h"
#include "kvrelay/decision/media.h"

#include "commands.h"
#include "plugin_warnings.h"

namespace kvrelay::cli {
namespace {

constexpr std::uint64_t kDefaultMaxBytes = std::uint64_t{64} << 30;

struct CodecOptions {
  std::vector<std::string> plugin_dirs;
  std::string codec = "lossless";
  std::string layout;
  std::uint64_t tokens = 0;
  codec::BuiltinParams params;
  double keep_fraction = 0.25;
  int stage_level = 3;
  std::string input;
  std::string output;
  std::string queries;
  std::uint32_t query_heads = 0;
  std::uint32_t sampled_queries = 16;
  std::uint64_t max_bytes = kDefaultMaxBytes;
  std::uint64_t seed = 1;
  std::string device = "cpu";   // encode/decode: "cuda" runs the codec's CUDA kernels
  bool policy_snippet = false;  // eval: print the policy's cost_model.media with the measured factors
};

int report(const Error& error) {
  std::fprintf(stderr, "error: %s\n", error.to_string().c_str());
  return 2;
}

codec::CodecRegistry make_registry(const CodecOptions& options) {
  auto registry = codec::CodecRegistry::with_builtins();
  warn_refused_plugins(registry.load_directories(options.plugin_dirs));
  return registry;
}

std::vector<std::uint8_t> params_for(const codec::Codec& chosen, const CodecOptions& options) {
  if (chosen.id() >= KVRELAY_CODEC_FIRST_PLUGIN_ID) return chosen.default_params();
  codec::BuiltinParams params = options.params;
  params.keep_permille = static_cast<std::uint32_t>(options.keep_fraction * 1000.0 + 0.5);
  const auto wire = params.serialize();
  return {wire.begin(), wire.end()};
}

void add_codec_params(CLI::App* command, CodecOptions& options) {
  command->add_option("--sink", options.params.sink_tokens, "Leading tokens kept exact (lossy codecs)");
  command->add_option("--recent", options.params.recent_tokens, "Trailing tokens kept exact (lossy codecs)");
  command->add_option("--group", options.params.group_size, "int8/int4 group size");
  command->add_option("--keep", options.keep_fraction, "sparse: fraction of middle tokens kept")
      ->check(CLI::Range(0.0, 1.0));
  command->add_option("--per-position", options.params.per_position,
                      "sparse: 1 (default) one set of positions for every layer and kv head, the kv_sparse "
                      "medium's rule; 0 a set per layer and kv head");
  command->add_option("--zstd-level", options.params.zstd_level, "lossless: zstd level per byte plane");
}

int run_list(const CodecOptions& options) {
  const auto registry = make_registry(options);
  std::printf("%-10s %-5s %-28s %s\n", "NAME", "ID", "FLAGS", "ORIGIN");
  for (const auto& codec : registry.codecs()) {
    std::printf("%-10s %-5u %-28s %s\n", std::string(codec->name()).c_str(), codec->id(), codec->flag_names().c_str(),
                codec->origin().c_str());
  }
  return 0;
}

// The implementation --device picks for `codec_id`: null for the CPU codec itself.
Result<const kvrelay_codec_plugin*> implementation_for(const CodecOptions& options, std::uint32_t codec_id) {
  if (options.device == "cpu") return static_cast<const kvrelay_codec_plugin*>(nullptr);
  return codec::cuda_implementation(codec_id);
}

int run_encode(const CodecOptions& options) {
  const auto registry = make_registry(options);
  auto spec = codec::resolve_codec(registry, options.codec);
  if (!spec) return report(spec.error());
  auto layout = codec::parse_layout_spec(options.layout, options.tokens);
  if (!layout) return report(layout.error());
  auto kv = codec::read_binary_file(options.input, options.max_bytes);
  if (!kv) return report(kv.error());
  codec::EncodeOptions encode;
  encode.zstd_stage = spec.value().zstd_stage;
  encode.zstd_level = options.stage_level;
  encode.params = params_for(*spec.value().codec, options);
  auto implementation = implementation_for(options, spec.value().codec->id());
  if (!implementation) return report(implementation.error());
  encode.implementation = implementation.value();
  auto frame = codec::encode_frame(*spec.value().codec, layout.value(), kv.value(), encode);
  if (!frame) return report(frame.error());
  if (auto written = codec::write_binary_file(options.output, frame.value()); !written) return report(written.error());
  std::printf("%s: %zu -> %zu bytes (ratio %.3f)\n", options.codec.c_str(), kv.value().size(), frame.value().size(),
              static_cast<double>(kv.value().size()) / static_cast<double>(frame.value().size()));
  return 0;
}

int run_decode(const CodecOptions& options) {
  const auto registry = make_registry(options);
  // A frame is never larger than the output bound plus its own header; refuse absurd files early.
  auto frame = codec::read_binary_file(options.input, options.max_bytes);
  if (!frame) return report(frame.error());
  auto header = codec::inspect_frame(frame.value());
  if (!header) return report(header.error());
  auto implementation = implementation_for(options, header.value().codec_id);
  if (!implementation) return report(implementation.error());
  auto kv = codec::decode_frame(registry, frame.value(), options.max_bytes, implementation.value());
  if (!kv) return report(kv.error());
  if (auto written = codec::write_binary_file(options.output, kv.value()); !written) return report(written.error());
  std::printf("%s: %s\n", std::string(registry.find(header.value().codec_id)->name()).c_str(),
              header.value().layout.describe().c_str());
  return 0;
}

nlohmann::json error_json(const codec::TensorError& error) {
  return {{"rel_l2", error.rel_l2},
          {"snr_db", std::isinf(error.snr_db) ? nlohmann::json("inf") : nlohmann::json(error.snr_db)},
          {"cosine", error.cosine},
          {"max_abs", error.max_abs}};
}

// The fidelity factor a hop through a codec costs on a chain (precision refresh, issue #27): what
// fraction of the attention output survives, measured on this sample; 1 for lossless codecs.
double fidelity_factor(double attn_rel_err) {
  if (!std::isfinite(attn_rel_err)) return 0.0;
  return std::clamp(1.0 - attn_rel_err, 0.0, 1.0);
}

// The policy medium that delivers what `codec` measures: the catalogue's (kv_int8 for int8 and
// int8+zstd, codec:NAME for a plugin), and kv_sparse for `sparse`, whose per-position rule is the
// one the kv_sparse medium keeps positions by (the catalogue names no codec for it, since its KV
// moves raw).
std::string medium_of(const codec::Codec& codec) {
  if (codec.id() == codec::kSparseCodecId) return "kv_sparse";
  return decision::medium_for_codec_spec(codec.name());
}

// cost_model.media for the lossy codecs measured: one entry per medium, the smallest factor of
// the specs that carry it (int8 and int8+zstd are both kv_int8). `sparse` counts for kv_sparse
// only with its per-position selection, the medium's rule.
nlohmann::json policy_snippet(const nlohmann::json& measured) {
  nlohmann::json media = nlohmann::json::object();
  for (const auto& codec : measured) {
    if (codec["lossless"].get<bool>()) continue;  // lossless media are exact: factor 1 always
    if (codec.contains("per_position") && !codec["per_position"].get<bool>()) {
      std::fprintf(stderr, "note: %s with --per-position 0 is not what kv_sparse delivers; left out of the snippet\n",
                   codec["codec"].get<std::string>().c_str());
      continue;
    }
    const std::string medium = codec["medium"].get<std::string>();
    const double factor = codec["fidelity_factor"].get<double>();
    if (!media.contains(medium) || media[medium]["fidelity"].get<double>() > factor)
      media[medium] = {{"fidelity", factor}};
  }
  return {{"cost_model", {{"media", std::move(media)}}}};
}

int run_eval(const CodecOptions& options) {
  const auto registry = make_registry(options);
  auto layout = codec::parse_layout_spec(options.layout, options.tokens);
  if (!layout) return report(layout.error());
  Result<std::vector<std::uint8_t>> kv = options.input.empty()
                                             ? codec::synthetic_kv(layout.value(), options.seed)
                                             : codec::read_binary_file(options.input, options.max_bytes);
  if (!kv) return report(kv.error());
  const std::uint32_t query_heads = options.query_heads == 0 ? layout.value().kv_heads : options.query_heads;
  codec::QuerySet queries;
  if (!options.queries.empty()) {
    auto bytes = codec::read_binary_file(options.queries, options.max_bytes);
    if (!bytes) return report(bytes.error());
    const std::size_t per_set =
        static_cast<std::size_t>(layout.value().layers) * query_heads * layout.value().head_dim * 4;
    if (bytes.value().empty() || bytes.value().size() % per_set != 0) {
      return report(
          Error{ErrorCode::kLayoutMismatch, "queries file is not fp32 [layers][count][query_heads][head_dim]"});
    }
    queries.query_heads = query_heads;
    queries.count = static_cast<std::uint32_t>(bytes.value().size() / per_set);
    queries.data.resize(bytes.value().size() / 4);
    std::memcpy(queries.data.data(), bytes.value().data(), bytes.value().size());
  } else {
    auto sampled =
        codec::sample_queries(layout.value(), kv.value(), options.sampled_queries, query_heads, options.seed);
    if (!sampled) return report(sampled.error());
    queries = std::move(sampled.value());
  }
  nlohmann::json out = nlohmann::json::array();
  std::string list = options.codec;
  std::size_t start = 0;
  while (start <= list.size()) {
    const std::size_t comma = std::min(list.find(',', start), list.size());
    const std::string name = list.substr(start, comma - start);
    start = comma + 1;
    auto spec = codec::resolve_codec(registry, name);
    if (!spec) return report(spec.error());
    const auto params = params_for(*spec.value().codec, options);
    auto quality = codec::evaluate(registry, spec.value(), layout.value(), kv.value(), queries, params);
    if (!quality) return report(quality.error());
    const auto& q = quality.value();
    nlohmann::json layers = nlohmann::json::array();
    for (const auto& layer : q.layers) {
      layers.push_back({{"k", error_json(layer.keys)},
                        {"v", error_json(layer.values)},
                        {"attn_rel_err", layer.attn_rel_err},
                        {"attention_top1_agreement", layer.attention_top1_agreement}});
    }
    const bool lossless = codec::fidelity_of(spec.value()).is_exact();
    nlohmann::json measured{{"codec", q.codec},
                            {"medium", medium_of(*spec.value().codec)},
                            {"lossless", lossless},
                            {"layout", q.layout.describe()},
                            {"raw_bytes", q.raw_bytes},
                            {"encoded_bytes", q.encoded_bytes},
                            {"ratio", q.ratio},
                            {"k", error_json(q.keys)},
                            {"v", error_json(q.values)},
                            {"attn_rel_err", q.attn_rel_err},
                            {"attention_top1_agreement", q.attention_top1_agreement},
                            {"fidelity_factor", lossless ? 1.0 : fidelity_factor(q.attn_rel_err)},
                            {"queries", queries.count},
                            {"query_heads", queries.query_heads},
                            {"layers", layers}};
    if (spec.value().codec->id() == codec::kSparseCodecId) {
      measured["per_position"] = options.params.per_position;
      measured["keep_permille"] = codec::BuiltinParams::parse(params.data(), params.size()).value().keep_permille;
    }
    out.push_back(std::move(measured));
  }
  std::printf("%s\n", (options.policy_snippet ? policy_snippet(out) : out).dump(2).c_str());
  return 0;
}

}  // namespace

void add_codec_command(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<CodecOptions>();
  auto* codec_command = app.add_subcommand("codec", "List, run and measure KV codecs on raw tensor files");
  codec_command->require_subcommand(1);
  codec_command->add_option("--plugin-dir", options->plugin_dirs, "Directories of codec plugins (*.so)");

  auto* list = codec_command->add_subcommand("list", "Print every codec with its flags and origin");
  list->callback([options, &exit_code] { exit_code = run_list(*options); });

  auto* encode =
      codec_command->add_subcommand("encode", "Encode a raw KV file (K then V, layer by layer) into a frame");
  encode->add_option("--codec", options->codec, "Codec, e.g. int4 or int4+zstd")->required();
  encode->add_option("--layout", options->layout, "L,H,D,DTYPE (DTYPE: fp32, fp16, bf16)")->required();
  encode->add_option("--tokens", options->tokens, "Token count")->required();
  encode->add_option("--stage-level", options->stage_level, "zstd level of a +zstd stage");
  encode->add_option("--device", options->device, "cpu, or cuda: the codec's CUDA kernels (same bytes)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  add_codec_params(encode, *options);
  encode->add_option("input", options->input, "Raw KV file")->required();
  encode->add_option("output", options->output, "Frame file")->required();
  encode->callback([options, &exit_code] { exit_code = run_encode(*options); });

  auto* decode = codec_command->add_subcommand("decode", "Check and decode a frame into a raw KV file");
  decode->add_option("--max-bytes", options->max_bytes, "Refuse frames whose KV exceeds this size");
  decode->add_option("--device", options->device, "cpu, or cuda: the codec's CUDA kernels (same bytes)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  decode->add_option("input", options->input, "Frame file")->required();
  decode->add_option("output", options->output, "Raw KV file")->required();
  decode->callback([options, &exit_code] { exit_code = run_decode(*options); });

  auto* eval = codec_command->add_subcommand("eval", "Measure codec error on a KV sample (JSON)");
  eval->add_option("--codec", options->codec, "Codecs, comma-separated")->required();
  eval->add_option("--layout", options->layout, "L,H,D,DTYPE")->required();
  eval->add_option("--tokens", options->tokens, "Token count")->required();
  eval->add_option("--queries", options->queries, "fp32 queries [layers][count][query_heads][head_dim]");
  eval->add_option("--query-heads", options->query_heads, "Query heads (GQA: a multiple of kv heads)");
  eval->add_option("--sample-queries", options->sampled_queries, "Queries sampled per layer when none are given");
  eval->add_option("--seed", options->seed, "Seed for synthetic KV and sampled queries");
  eval->add_flag("--policy-snippet", options->policy_snippet,
                 "Print the policy's cost_model.media with each lossy codec's fidelity_factor instead");
  add_codec_params(eval, *options);
  eval->add_option("input", options->input, "Raw KV file (omitted: synthetic KV with outlier key channels)");
  eval->callback([options, &exit_code] { exit_code = run_eval(*options); });
}

}  // namespace kvrelay::cli
