#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cstring>

#include "kvrelay/refworker/kv_dump.h"
#include "skip.h"
#include "support/child_process.h"
#include "support/refworker_process.h"

using kvrelay::test::refworker_binary;
using kvrelay::test::run_command;

TEST_CASE("refworker cli: generate prints the greedy ids", "[refworker][cli]") {
  const auto path = kvrelay::test::stories_model_path();
  if (!path) KVRELAY_SKIP("stories260K.bin not found");
  kvrelay::test::TempDir dir;
  const auto result = run_command({refworker_binary().string(), "generate", "--model", path->string(), "--prompt", "1",
                                   "--max-tokens", "8", "--ignore-eos"},
                                  dir.path());
  INFO(result.err);
  CHECK(result.exit_status == 0);
  CHECK(result.out == "461 461 401 401 401 461 378 455\n");

  const auto bad = run_command({refworker_binary().string(), "generate", "--synthetic", "layers=2,dim=30,heads=4"},
                               dir.path());
  CHECK(bad.exit_status == 1);
  CHECK(bad.err.find("divisible") != std::string::npos);
}

TEST_CASE("refworker cli: dump-kv writes the KV, the queries and their layout", "[refworker][cli]") {
  const auto path = kvrelay::test::stories_model_path();
  if (!path) KVRELAY_SKIP("stories260K.bin not found");
  kvrelay::test::TempDir dir;
  const auto out = dir / "dump";
  const auto result = run_command({refworker_binary().string(), "dump-kv", "--model", path->string(), "--tokens", "40",
                                   "--queries", "4", "--out", out.string()},
                                  dir.path());
  INFO(result.err);
  REQUIRE(result.exit_status == 0);
  const auto layout = nlohmann::json::parse(kvrelay::test::read_file(out / "layout.json"));
  CHECK(layout["layers"] == 5);
  CHECK(layout["kv_heads"] == 4);
  CHECK(layout["head_dim"] == 8);
  CHECK(layout["dtype"] == "fp32");
  CHECK(layout["tokens"] == 40);
  CHECK(layout["queries"]["shape"] == nlohmann::json::array({5, 4, 8, 8}));
  const auto tokens = layout["token_ids"].get<std::vector<std::int32_t>>();
  REQUIRE(tokens.size() == 40);
  CHECK(tokens[0] == 1);
  CHECK(tokens[1] == 461);  // the model's own greedy text
  const std::string kv = kvrelay::test::read_file(out / "kv.bin");
  const std::string queries = kvrelay::test::read_file(out / "queries.bin");
  REQUIRE(kv.size() == 40U * 1280U);
  REQUIRE(queries.size() == 5U * 4U * 8U * 8U * 4U);

  // The files hold what the engine computes for those tokens (up to BLAS summation order,
  // which depends on the thread count).
  auto model = kvrelay::refworker::load_llama2c(*path);
  REQUIRE(model);
  auto dump = kvrelay::refworker::dump_kv(model.value(), tokens, 4);
  REQUIRE(dump);
  auto check_floats = [](const std::string& bytes, const std::vector<float>& expected) {
    REQUIRE(bytes.size() == expected.size() * sizeof(float));
    std::vector<float> got(expected.size());
    std::memcpy(got.data(), bytes.data(), bytes.size());
    for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(got[i] == Approx(expected[i]).margin(1e-4));
  };
  check_floats(kv, dump.value().kv);
  check_floats(queries, dump.value().queries.data);
}
