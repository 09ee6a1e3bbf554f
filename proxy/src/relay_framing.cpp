#include "kvrelay/proxy/relay_framing.h"

#include <fmt/format.h>

namespace kvrelay::proxy {

std::string relayed_response_header(const http::response_header<>& upstream, RelayFraming framing,
                                    std::uint64_t content_length, bool keep_alive) {
  std::string header;
  header.reserve(256);
  // The reason phrase is the upstream's own (the parser keeps it), empty included.
  fmt::format_to(std::back_inserter(header), "HTTP/1.1 {} {}\r\n", upstream.result_int(),
                 std::string_view(upstream.reason()));
  for (const auto& field : upstream) {
    if (is_hop_by_hop(field.name()) || field.name() == http::field::content_length) continue;
    header.append(field.name_string());
    header.append(": ");
    header.append(field.value());
    header.append("\r\n");
  }
  if (framing == RelayFraming::kChunked) {
    header.append("Transfer-Encoding: chunked\r\n");
  } else {
    fmt::format_to(std::back_inserter(header), "Content-Length: {}\r\n", content_length);
  }
  if (!keep_alive) header.append("Connection: close\r\n");
  header.append("\r\n");
  return header;
}

std::string_view format_chunk_size_line(std::size_t size, ChunkSizeLine& line) {
  const auto end = fmt::format_to_n(line.data(), line.size(), "{:x}\r\n", size);
  return {line.data(), end.size};
}

}  // namespace kvrelay::proxy
