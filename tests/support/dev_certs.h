#pragma once

// Development certificates for TLS peer tests, made by scripts/make-dev-certs.sh (the openssl
// CLI) into a temporary directory: a CA, and a certificate and key per node id.

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "kvrelay/core/policy.h"
#include "kvrelay/peer/peer_tls.h"

#include "support/child_process.h"
#include "support/test_paths.h"

namespace kvrelay::test {

class DevCerts {
 public:
  // `environment`: "NAME=value" for the script (KVRELAY_CERT_STARTDATE/ENDDATE: explicit validity).
  explicit DevCerts(const std::vector<std::string>& ids, const std::vector<std::string>& environment = {}) {
    add(ids, environment);
  }
  // Node certificates from `ca`'s CA, in a directory of their own (an expired one beside a valid
  // one of the same id).
  DevCerts(const DevCerts& ca, const std::vector<std::string>& ids, const std::vector<std::string>& environment) {
    std::filesystem::copy_file(ca.dir_ / "ca.pem", dir_ / "ca.pem");
    std::filesystem::copy_file(ca.dir_ / "ca-key.pem", dir_ / "ca-key.pem");
    add(ids, environment);
  }
  // Node certificates from this CA (one of the same id is replaced).
  void add(const std::vector<std::string>& ids, const std::vector<std::string>& environment = {}) const {
    std::vector<std::string> command{"/usr/bin/env"};  // run_command does not search PATH
    command.insert(command.end(), environment.begin(), environment.end());
    command.push_back((source_dir() / "scripts" / "make-dev-certs.sh").string());
    command.push_back(dir_.path().string());
    command.insert(command.end(), ids.begin(), ids.end());
    const auto made = run_command(command, dir_.path());
    INFO(made.err);
    REQUIRE(made.exit_status == 0);
  }
  [[nodiscard]] std::string ca() const { return (dir_ / "ca.pem").string(); }
  [[nodiscard]] std::string certificate(const std::string& id) const { return (dir_ / (id + ".pem")).string(); }
  [[nodiscard]] std::string key(const std::string& id) const { return (dir_ / (id + "-key.pem")).string(); }
  // The policy's peer_tls section for node `id`.
  [[nodiscard]] nlohmann::json peer_tls(const std::string& id) const {
    return {{"certificate", certificate(id)}, {"private_key", key(id)}, {"ca_bundle", ca()}};
  }
  // A client's TLS as node `id` ("": one that presents no certificate), trusting `ca_bundle`
  // ("": this CA).
  [[nodiscard]] std::shared_ptr<peer::PeerTls> client(const std::string& id, const std::string& ca_bundle = {}) const {
    PeerTlsPolicy files;
    if (!id.empty()) {
      files.certificate = certificate(id);
      files.private_key = key(id);
    }
    files.ca_bundle = ca_bundle.empty() ? ca() : ca_bundle;
    auto tls = peer::PeerTls::load(files);
    if (!tls) FAIL("client TLS: " << tls.error().to_string());
    return std::move(tls).value();
  }
  [[nodiscard]] const TempDir& dir() const { return dir_; }

 private:
  TempDir dir_;
};

// A spiffe ID as scripts/make-dev-certs.sh writes it into node `id`'s certificate.
inline std::string dev_spiffe_id(const std::string& id) {
  return "spiffe://kvrelay.dev/node/" + id;
}

}  // namespace kvrelay::test
