// GET /admin/kv/sample on a real sidecar (issue #28): a completion through the front proxy
// publishes the trained model's KV, the endpoint hands its raw bytes back, and `kvrelay codec
// eval` measures codecs on them, so the fidelity of kv_sparse and the others comes from live KV.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "support/kv_path_fixture.h"
#include "support/skip.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

std::string error_type(const HttpResult& reply) {
  const auto body = json::parse(reply.body, nullptr, false);
  if (!body.is_object() || !body.contains("error")) return "";
  return body["error"].value("type", "");
}

}  // namespace

TEST_CASE("GET /admin/kv/sample serves a published entry's KV that kvrelay codec eval measures",
          "[proxy][kv_sample][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  Sidecar node("node-1");
  RefworkerUnderTest worker({"--model", model->string()}, {"--kvrelay-socket", node.socket_path()});
  node.start(sidecar_policy(node, json::array({agent_json("writer", "", worker.port(), stories_model_json())}),
                            json::array()));

  {  // Nothing published yet: a JSON 404; bad queries are 400s.
    const auto none = admin_request(node.admin_port(), "GET", "/admin/kv/sample");
    CHECK(none.status == 404);
    CHECK(error_type(none) == "not_found");
    CHECK(admin_request(node.admin_port(), "GET", "/admin/kv/sample?key=xyz").status == 400);
    CHECK(admin_request(node.admin_port(), "GET", "/admin/kv/sample?limit=3").status == 400);
    CHECK(admin_request(node.admin_port(), "GET", "/admin/kv/sample?model=00000000000000aa").status == 400);
    // Prompt-derived content: the admin token even for this read, and admin only: the agent
    // listener does not serve it.
    CHECK(http_request(node.admin_port(), "GET", "/admin/kv/sample").status == 401);
    CHECK(http_request(node.http_port(), "GET", "/admin/kv/sample").status == 404);
  }

  const auto reply = node.complete("writer", greedy(context_prompt(3), 20, true));
  const auto published = reply["kvrelay"]["published_tokens"].get<std::uint64_t>();
  REQUIRE(published >= 200);
  const auto listing = json::parse(http_request(node.admin_port(), "GET", "/admin/kv").body);
  REQUIRE(listing["top"].size() >= 1);
  const auto listed = listing["top"][0];
  const std::string key = listed["key"];
  const std::string model_id = listed["model_id"];
  const auto tokens = listed["tokens"].get<std::uint64_t>();
  CHECK(tokens <= published);  // the whole 16-token blocks of the context
  CHECK(tokens >= published - 15);

  const auto sample = admin_request(node.admin_port(), "GET", "/admin/kv/sample");
  INFO(sample.body.substr(0, 200));
  REQUIRE(sample.status == 200);
  CHECK(sample.headers.at("content-type") == "application/octet-stream");
  CHECK(sample.headers.at("x-kvrelay-layout") == "5,4,8,fp32");
  CHECK(sample.headers.at("x-kvrelay-tokens") == std::to_string(tokens));
  CHECK(sample.headers.at("x-kvrelay-key") == key);
  CHECK(sample.headers.at("x-kvrelay-model") == model_id);
  CHECK(sample.headers.at("x-kvrelay-fidelity") == "exact");
  REQUIRE(sample.body.size() == 2 * 5 * 4 * 8 * 4 * tokens);  // K and V, 5 layers, 4 x 8 fp32 per token

  // The same entry by its key, with or without the model id; an unknown key is a JSON 404.
  CHECK(admin_request(node.admin_port(), "GET", "/admin/kv/sample?key=" + key).body == sample.body);
  CHECK(admin_request(node.admin_port(), "GET", "/admin/kv/sample?key=" + key + "&model=" + model_id).body ==
        sample.body);
  const auto unknown = admin_request(node.admin_port(), "GET", "/admin/kv/sample?key=0123456789abcdef");
  CHECK(unknown.status == 404);
  CHECK(error_type(unknown) == "not_found");
  CHECK_THAT(unknown.body, Catch::Contains("0123456789abcdef"));

  // curl -o kv.bin, then kvrelay codec eval on it.
  TempDir dir;
  write_file(dir / "kv.bin", sample.body);
  std::vector<std::string> eval{kvrelay_binary().string(),
                                "codec",
                                "eval",
                                "--codec",
                                "int8,sparse",
                                "--layout",
                                sample.headers.at("x-kvrelay-layout"),
                                "--tokens",
                                sample.headers.at("x-kvrelay-tokens"),
                                "--query-heads",
                                "8",
                                (dir / "kv.bin").string()};
  const auto measured = run_command(eval, dir.path());
  INFO(measured.err);
  REQUIRE(measured.exit_status == 0);
  const auto codecs = json::parse(measured.out);
  REQUIRE(codecs.size() == 2);
  CHECK(codecs[0]["codec"] == "int8");
  CHECK(codecs[0]["k"]["rel_l2"].get<double>() > 0);
  CHECK(codecs[0]["attn_rel_err"].get<double>() > 0);
  CHECK(codecs[0]["attn_rel_err"].get<double>() < 0.05);
  CHECK(codecs[1]["medium"] == "kv_sparse");
  CHECK(codecs[1]["attention_top1_agreement"].get<double>() > 0);
  CHECK(codecs[1]["attention_top1_agreement"].get<double>() <= 1.0);

  eval.insert(eval.end() - 1, "--policy-snippet");
  const auto snippet = run_command(eval, dir.path());
  INFO(snippet.err);
  REQUIRE(snippet.exit_status == 0);
  const auto media = json::parse(snippet.out)["cost_model"]["media"];
  REQUIRE(media.contains("kv_sparse"));
  REQUIRE(media.contains("kv_int8"));
  CHECK(media["kv_sparse"]["fidelity"].get<double>() == Approx(codecs[1]["fidelity_factor"].get<double>()));
  CHECK(media["kv_int8"]["fidelity"].get<double>() > media["kv_sparse"]["fidelity"].get<double>());
}
