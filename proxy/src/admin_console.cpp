#include "admin_console.h"

#include <fmt/format.h>

#include <array>
#include <memory>
#include <openssl/evp.h>
#include <openssl/sha.h>

// Generated at build time from proxy/console/console.html (cmake/KvrelayConsole.cmake).
#include "kvrelay_console_page.h"

namespace kvrelay::proxy {

namespace admin_console_detail {

// 'sha256-<base64>' of one inline block, as CSP level 2 hash sources spell it.
std::string csp_hash_source(std::string_view text) {
  std::array<unsigned char, SHA256_DIGEST_LENGTH> digest{};
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest.data());
  // Base64 of 32 bytes: 44 characters and the terminating NUL EVP_EncodeBlock writes.
  std::array<unsigned char, 4 * ((SHA256_DIGEST_LENGTH + 2) / 3) + 1> encoded{};
  const int length = EVP_EncodeBlock(encoded.data(), digest.data(), static_cast<int>(digest.size()));
  return fmt::format("'sha256-{}'",
                     std::string_view(reinterpret_cast<const char*>(encoded.data()), static_cast<std::size_t>(length)));
}

// The hash sources of every block between `open` and `close` in the page (its own markup, so
// the tags are spelled exactly so: no attributes).
std::string inline_block_hashes(std::string_view page, std::string_view open, std::string_view close) {
  std::string sources;
  for (auto start = page.find(open); start != std::string_view::npos; start = page.find(open, start)) {
    start += open.size();
    const auto end = page.find(close, start);
    if (end == std::string_view::npos) break;
    if (!sources.empty()) sources += ' ';
    sources += csp_hash_source(page.substr(start, end - start));
    start = end + close.size();
  }
  // A page without a block of this kind may run none: 'none' rather than an empty list.
  return sources.empty() ? std::string("'none'") : sources;
}

}  // namespace admin_console_detail

std::string_view console_page() {
  return console_assets::kConsolePage;
}

std::string console_content_security_policy(std::string_view page) {
  return fmt::format(
      "default-src 'none'; script-src {}; style-src {}; connect-src 'self'; img-src data:; "
      "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
      admin_console_detail::inline_block_hashes(page, "<script>", "</script>"),
      admin_console_detail::inline_block_hashes(page, "<style>", "</style>"));
}

std::vector<AdminEndpoint> console_endpoints() {
  // The page is fixed at build time: its policy is computed once.
  auto policy = std::make_shared<const std::string>(console_content_security_policy(console_page()));
  return {
      // The page carries no data (every figure it shows comes from an admin call that carries the
      // token), so serving it needs none: public, on the admin listener only.
      {http::verb::get, Access::kPublic, "/admin/ui",
       "The web console: one self-contained page (routes, decisions with cost breakdowns, peers, KV store, audit) "
       "that reads and changes this admin API with the admin token; docs/console.md",
       [policy](const HttpRequest& request) {
         auto response =
             make_text_response(http::status::ok, std::string(console_page()), "text/html; charset=utf-8", request);
         response.set("Content-Security-Policy", *policy);
         response.set("X-Content-Type-Options", "nosniff");
         response.set("Referrer-Policy", "no-referrer");
         response.set(http::field::x_frame_options, "DENY");
         response.set(http::field::cache_control, "no-store");
         return response;
       }},
  };
}

}  // namespace kvrelay::proxy
