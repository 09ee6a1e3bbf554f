#include <nlohmann/json.hpp>

#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "kvrelay/broker/engine_codecs.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/decision/decision_json.h"
#include "kvrelay/decision/engine_from_policy.h"

#include "commands.h"
#include "plugin_warnings.h"

namespace kvrelay::cli {

namespace {

struct ExplainOptions {
  std::string policy_file;
  std::string route;
  std::uint64_t tokens = 0;
  std::uint64_t cached = 0;
  std::optional<double> link_gbps;
  std::optional<double> rtt_us;
  double chain_fidelity = 1.0;
  std::uint32_t output_tokens = 256;
};

int explain(const ExplainOptions& options) {
  // An explanation needs the policy's routes and agents, not the admin token it names.
  auto policy = load_policy_file(options.policy_file, PolicySecrets::kSkip);
  if (!policy) {
    std::fprintf(stderr, "%s\n", policy.error().message.c_str());
    return 1;
  }
  decision::LinkPriors priors;
  priors.shm_bytes_per_s = decision::measure_copy_bandwidth();
  // The policy's plugin codecs are media here as in the daemon: a plugin medium whose codec
  // loads is priced, one whose codec does not is listed as codec_unavailable.
  auto codecs = codec::CodecRegistry::with_builtins();
  warn_refused_plugins(codecs.load_directories(policy.value().codecs.plugin_dirs));
  auto engine = decision::engine_from_policy(policy.value(), priors, {}, broker::engine_codecs(codecs));
  if (!engine) {
    std::fprintf(stderr, "%s\n", engine.error().to_string().c_str());
    return 1;
  }
  auto& e = engine.value();
  const auto route = e.find_route(options.route);
  if (!route) {
    std::fprintf(stderr, "%s\n", route.error().to_string().c_str());
    return 1;
  }
  const RoutePolicy* route_policy = policy.value().find_route(options.route);
  const std::string link_id = decision::route_link_id(policy.value(), *route_policy);
  const auto link = e.find_link(link_id).value();
  // What-if link figures enter as one measurement, exactly as a probe result would.
  if (options.link_gbps) {
    const double bytes_per_s = *options.link_gbps * 1e9 / 8.0;
    e.observe_link(link, bytes_per_s, 1.0);
  }
  if (options.rtt_us) {
    e.observe_rtt(link, *options.rtt_us * 1e-6);
  }
  decision::TransferShape shape;
  shape.tokens = options.tokens;
  shape.receiver_cached = options.cached;
  shape.chain_fidelity = options.chain_fidelity;
  shape.expected_output_tokens = options.output_tokens;
  const auto decided = e.decide(route.value(), shape);
  if (!decided) {
    std::fprintf(stderr, "%s\n", decided.error().to_string().c_str());
    return 1;
  }
  nlohmann::json out = decision::decision_to_json(decided.value(), e);
  out["estimates"] = {{"link", link_id}, {"link_bytes_per_s", e.link_bytes_per_s(link)}, {"rtt_s", e.link_rtt_s(link)}};
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}

}  // namespace

void add_decision_command(CLI::App& app, int& exit_code) {
  auto* command = app.add_subcommand("decision", "Inspect the decision engine");
  command->require_subcommand(1);
  auto options = std::make_shared<ExplainOptions>();
  auto* explain_command =
      command->add_subcommand("explain", "Print the full cost breakdown of one transfer on a route, as JSON");
  explain_command->add_option("--policy", options->policy_file, "Policy file (JSON)")->required();
  explain_command->add_option("--route", options->route, "Route id")->required();
  explain_command->add_option("--tokens", options->tokens, "Context length at the sender")->required();
  explain_command->add_option("--cached", options->cached, "Leading tokens the receiver already holds");
  explain_command->add_option("--link-gbps", options->link_gbps, "Link throughput to assume (Gbit/s)");
  explain_command->add_option("--rtt-us", options->rtt_us, "Link round trip to assume (microseconds)");
  explain_command->add_option("--chain-fidelity", options->chain_fidelity, "Fidelity product of earlier lossy hops")
      ->check(CLI::Range(0.0, 1.0));
  explain_command->add_option("--output-tokens", options->output_tokens, "Expected generated tokens");
  explain_command->callback([options, &exit_code] { exit_code = explain(*options); });
}

}  // namespace kvrelay::cli
