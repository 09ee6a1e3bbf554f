#include <fmt/format.h>

#include <memory>
#include <random>

#include "cli_util.h"
#include "commands.h"
#include "kvrelay/refworker/generation.h"
#include "kvrelay/refworker/kv_dump.h"

namespace kvrelay::refworker::cli {

namespace {

struct DumpOptions {
  ModelSource source;
  int blas_threads = 1;
  std::uint32_t tokens = 128;
  std::uint32_t queries = 8;
  std::string out_dir;
  std::string prompt;
  bool random_prompt = false;
};

// The model's own greedy text from BOS: attention patterns of real text, not noise. Synthetic
// or very long dumps can ask for seeded random ids instead, which cost one prefill.
Result<std::vector<std::int32_t>> make_prompt(const Model& model, const DumpOptions& options) {
  if (!options.prompt.empty()) return parse_token_list(options.prompt);
  std::vector<std::int32_t> tokens{kBosToken};
  if (options.random_prompt) {
    std::mt19937 rng(static_cast<std::uint32_t>(options.source.seed));
    std::uniform_int_distribution<std::int32_t> pick(3, static_cast<std::int32_t>(model.config().vocab_size) - 1);
    while (tokens.size() < options.tokens) tokens.push_back(pick(rng));
    return tokens;
  }
  if (options.tokens <= 1) return tokens;
  InferenceSession session(model);
  KVRELAY_TRY(const auto logits, session.prefill(tokens));
  GenerationOptions generation;
  generation.max_tokens = options.tokens - 1;
  generation.stop_at_eos = false;
  KVRELAY_TRY(const auto result, generate(session, logits, generation));
  tokens.insert(tokens.end(), result.tokens.begin(), result.tokens.end());
  return tokens;
}

int run_dump(const DumpOptions& options) {
  apply_blas_threads(options.blas_threads);
  auto model = load_model(options.source);
  if (!model) return report_error(model.error());
  auto prompt = make_prompt(model.value(), options);
  if (!prompt) return report_error(prompt.error());
  auto dump = dump_kv(model.value(), prompt.value(), options.queries);
  if (!dump) return report_error(dump.error());
  if (auto written = write_kv_dump(dump.value(), model.value(), prompt.value(), options.out_dir); !written) {
    return report_error(written.error());
  }
  fmt::print("wrote {} ({} bytes of KV, {} query positions) to {}\n", dump.value().layout.describe(),
             dump.value().kv.size() * sizeof(float), options.queries, options.out_dir);
  return 0;
}

}  // namespace

void add_dump_kv_command(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<DumpOptions>();
  auto* command = app.add_subcommand("dump-kv", "Write a prompt's KV (kv.bin), last queries (queries.bin), layout.json");
  add_model_options(*command, options->source);
  add_blas_threads_option(*command, options->blas_threads);
  command->add_option("--tokens", options->tokens, "Prompt length (BOS + the model's greedy continuation)")
      ->check(CLI::Range(1U, 1U << 20));
  command->add_option("--queries", options->queries, "Query positions to capture (the last M of the prompt)")
      ->check(CLI::Range(0U, 1U << 20));
  command->add_option("--out", options->out_dir, "Output directory")->required();
  command->add_option("--prompt", options->prompt, "Explicit comma-separated token ids instead");
  command->add_flag("--random-prompt", options->random_prompt, "Seeded random ids instead of greedy text");
  command->callback([options, &exit_code] { exit_code = run_dump(*options); });
}

}  // namespace kvrelay::refworker::cli
