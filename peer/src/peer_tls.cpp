#include "kvrelay/peer/peer_tls.h"

#include <sys/stat.h>

#include <boost/asio/ssl/context.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <ctime>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include "peer_io.h"

namespace kvrelay::peer {

namespace ssl = boost::asio::ssl;

namespace {

std::chrono::system_clock::time_point asn1_time_point(const ASN1_TIME* time) {
  std::tm parts{};
  if (time == nullptr || ASN1_TIME_to_tm(time, &parts) != 1) return {};
  return std::chrono::system_clock::from_time_t(timegm(&parts));
}

Result<std::shared_ptr<ssl::context>> build_context(const PeerTlsPolicy& files) {
  auto context = std::make_shared<ssl::context>(ssl::context::tls);
  SSL_CTX* native = context->native_handle();
  // TLS 1.3 only; no session tickets (a peer link is one long connection, and tickets would be
  // one more message after every handshake).
  SSL_CTX_set_min_proto_version(native, TLS1_3_VERSION);
  SSL_CTX_set_max_proto_version(native, TLS1_3_VERSION);
  SSL_CTX_set_num_tickets(native, 0);
  boost::system::error_code ec;
  if (!files.certificate.empty()) {
    context->use_certificate_chain_file(files.certificate, ec);
    if (ec)
      return fail(ErrorCode::kInvalidArgument, fmt::format("{}: certificate: {}", files.certificate, ec.message()));
    context->use_private_key_file(files.private_key, ssl::context::pem, ec);
    if (ec)
      return fail(ErrorCode::kInvalidArgument, fmt::format("{}: private key: {}", files.private_key, ec.message()));
    if (SSL_CTX_check_private_key(native) != 1) {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("{}: the private key does not match {}", files.private_key, files.certificate));
    }
  }
  context->load_verify_file(files.ca_bundle, ec);
  if (ec) return fail(ErrorCode::kInvalidArgument, fmt::format("{}: CA bundle: {}", files.ca_bundle, ec.message()));
  // Both ends verify: a server refuses a client without a certificate.
  context->set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert, ec);
  if (ec) return fail(ErrorCode::kInternal, fmt::format("TLS verify mode: {}", ec.message()));
  return context;
}

}  // namespace

bool names_identity(const PeerCertificate& certificate, std::string_view identity) {
  return !identity.empty() &&
         std::find(certificate.names.begin(), certificate.names.end(), identity) != certificate.names.end();
}

double seconds_until(std::chrono::system_clock::time_point when) {
  return std::chrono::duration<double>(when - std::chrono::system_clock::now()).count();
}

Result<std::shared_ptr<PeerTls>> PeerTls::load(const PeerTlsPolicy& files) {
  std::shared_ptr<PeerTls> tls(new PeerTls(files));
  KVRELAY_TRY(tls->reload());
  return tls;
}

std::shared_ptr<PeerTls::Context> PeerTls::context() const {
  const std::lock_guard lock(mutex_);
  return context_;
}

std::chrono::system_clock::time_point PeerTls::not_after() const {
  const std::lock_guard lock(mutex_);
  return not_after_;
}

std::string PeerTls::stamp() const {
  std::string out;
  for (const std::string* path : {&files_.certificate, &files_.private_key, &files_.ca_bundle}) {
    struct stat info {};
    if (path->empty() || ::stat(path->c_str(), &info) != 0) {
      out += "-;";
      continue;
    }
    out += fmt::format("{}.{}:{}:{};", info.st_mtim.tv_sec, info.st_mtim.tv_nsec, info.st_size, info.st_ino);
  }
  return out;
}

Status PeerTls::reload() {
  const std::string files_stamp = stamp();
  auto built = build_context(files_);
  const std::lock_guard lock(mutex_);
  stamp_ = files_stamp;  // a bad file is reported once, not at every poll
  if (!built) return built.error();
  context_ = std::move(built).value();
  const X509* mine = SSL_CTX_get0_certificate(context_->native_handle());  // none: a client without one
  not_after_ = mine != nullptr ? asn1_time_point(X509_get0_notAfter(mine)) : std::chrono::system_clock::time_point{};
  return ok();
}

Result<bool> PeerTls::reload_if_changed() {
  {
    const std::lock_guard lock(mutex_);
    if (stamp() == stamp_) return false;
  }
  KVRELAY_TRY(reload());
  return true;
}

namespace detail {

PeerCertificate certificate_of(const SSL* session) {
  PeerCertificate out;
  X509* certificate = SSL_get0_peer_certificate(session);
  if (certificate == nullptr) return out;
  out.not_after = asn1_time_point(X509_get0_notAfter(certificate));
  auto* names = static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(certificate, NID_subject_alt_name, nullptr, nullptr));
  if (names == nullptr) return out;
  for (int index = 0; index < sk_GENERAL_NAME_num(names); ++index) {
    const GENERAL_NAME* name = sk_GENERAL_NAME_value(names, index);
    const ASN1_STRING* text = nullptr;
    if (name->type == GEN_DNS) text = name->d.dNSName;
    if (name->type == GEN_URI) text = name->d.uniformResourceIdentifier;
    if (text != nullptr) {
      out.names.emplace_back(reinterpret_cast<const char*>(ASN1_STRING_get0_data(text)),
                             static_cast<std::size_t>(ASN1_STRING_length(text)));
    } else if (name->type == GEN_IPADD && name->d.iPAddress != nullptr) {  // IPv4 only: policy hosts
      const auto* bytes = ASN1_STRING_get0_data(name->d.iPAddress);
      if (ASN1_STRING_length(name->d.iPAddress) == 4) {
        out.names.push_back(fmt::format("{}.{}.{}.{}", bytes[0], bytes[1], bytes[2], bytes[3]));
      }
    }
  }
  GENERAL_NAMES_free(names);
  return out;
}

}  // namespace detail

}  // namespace kvrelay::peer
