#include <fmt/format.h>

#include <chrono>
#include <memory>

#include "cli_util.h"
#include "commands.h"
#include "kvrelay/refworker/generation.h"

namespace kvrelay::refworker::cli {

namespace {

struct GenerateOptions {
  ModelSource source;
  int blas_threads = 1;
  std::string prompt = "1";
  GenerationOptions generation;
};

int run_generate(const GenerateOptions& options) {
  apply_blas_threads(options.blas_threads);
  auto model = load_model(options.source);
  if (!model) return report_error(model.error());
  auto prompt = parse_token_list(options.prompt);
  if (!prompt) return report_error(prompt.error());
  InferenceSession session(model.value());
  const auto started = std::chrono::steady_clock::now();
  auto logits = session.prefill(prompt.value());
  if (!logits) return report_error(logits.error());
  const auto prefilled = std::chrono::steady_clock::now();
  auto result = generate(session, logits.value(), options.generation);
  if (!result) return report_error(result.error());
  const auto finished = std::chrono::steady_clock::now();
  fmt::print("{}\n", fmt::join(result.value().tokens, " "));
  fmt::print(stderr, "prefill {} tokens in {:.1f} ms, {} tokens generated in {:.1f} ms\n", prompt.value().size(),
             std::chrono::duration<double, std::milli>(prefilled - started).count(), result.value().tokens.size(),
             std::chrono::duration<double, std::milli>(finished - prefilled).count());
  return 0;
}

}  // namespace

void add_generate_command(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<GenerateOptions>();
  auto* command = app.add_subcommand("generate", "Run a prompt of token ids and print the generated ids");
  add_model_options(*command, options->source);
  add_blas_threads_option(*command, options->blas_threads);
  command->add_option("--prompt", options->prompt, "Comma-separated token ids (default: BOS)");
  command->add_option("--max-tokens", options->generation.max_tokens, "Tokens to generate");
  command->add_option("--temperature", options->generation.sampling.temperature, "0: greedy");
  command->add_option("--top-k", options->generation.sampling.top_k, "0: whole vocabulary");
  command->add_option("--sample-seed", options->generation.sampling.seed, "Seed of the sampler");
  command->add_flag("!--ignore-eos", options->generation.stop_at_eos, "Keep generating after EOS");
  command->callback([options, &exit_code] { exit_code = run_generate(*options); });
}

}  // namespace kvrelay::refworker::cli
