#include "cli_util.h"

#include <cblas.h>
#include <fmt/format.h>

#include <charconv>
#include <cstdio>

namespace kvrelay::refworker::cli {

void add_model_options(CLI::App& command, ModelSource& source) {
  auto* model = command.add_option("--model", source.checkpoint_path, "llama2.c .bin checkpoint")
                    ->check(CLI::ExistingFile);
  auto* synthetic = command.add_option("--synthetic", source.synthetic_shape,
                                       "Seeded synthetic weights, e.g. layers=16,dim=1024,heads=16,kv_heads=4,"
                                       "ffn=2816,vocab=32000[,seq_len=4096]");
  model->excludes(synthetic);
  command.add_option("--seed", source.seed, "Seed of the synthetic weights");
}

void add_blas_threads_option(CLI::App& command, int& threads) {
  command.add_option("--blas-threads", threads, "OpenBLAS threads (0: OpenBLAS default, all cores)")
      ->check(CLI::Range(0, 1024));
}

void apply_blas_threads(int threads) {
  if (threads > 0) openblas_set_num_threads(threads);
}

Result<std::vector<std::int32_t>> parse_token_list(const std::string& text) {
  std::vector<std::int32_t> tokens;
  std::string_view rest = text;
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    std::int32_t value = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (ec != std::errc{} || end != item.data() + item.size() || item.empty()) {
      return fail(ErrorCode::kInvalidArgument, fmt::format("token '{}' is not an integer", item));
    }
    tokens.push_back(value);
  }
  if (tokens.empty()) return fail(ErrorCode::kInvalidArgument, "empty token list");
  return tokens;
}

int report_error(const Error& error) {
  std::fprintf(stderr, "error: %s\n", error.to_string().c_str());
  return 1;
}

}  // namespace kvrelay::refworker::cli
