#pragma once

// The bytes the upstream relay writes to the client, framed by hand so that a response header, a
// batch of events and the chunked framing around them leave in one gathered write (Beast's
// serializer would need a write per piece, and its state machine per chunk).

#include <array>
#include <cstddef>
#include <string>
#include <string_view>

#include "kvrelay/proxy/http_types.h"

namespace kvrelay::proxy {

enum class RelayFraming {
  kContentLength,  // the upstream said how long the body is: it is passed on as is
  kChunked,        // chunked or close-delimited upstream body: re-chunked per write
};

// The client-side header of a relayed response: HTTP/1.1, the upstream's status, reason and
// end-to-end fields, minus hop-by-hop ones, with this hop's framing (Content-Length: content_length
// or Transfer-Encoding: chunked) and Connection: close when the client connection ends after it.
[[nodiscard]] std::string relayed_response_header(const http::response_header<>& upstream, RelayFraming framing,
                                                  std::uint64_t content_length, bool keep_alive);

// Longest chunk-size line: 16 hex digits and CRLF.
inline constexpr std::size_t kChunkSizeLineBytes = 18;
using ChunkSizeLine = std::array<char, kChunkSizeLineBytes>;

// Writes "<size in hex>\r\n" into `line` and returns a view of it.
[[nodiscard]] std::string_view format_chunk_size_line(std::size_t size, ChunkSizeLine& line);

inline constexpr std::string_view kChunkEnd = "\r\n";
inline constexpr std::string_view kLastChunk = "0\r\n\r\n";
inline constexpr std::string_view kChunkEndAndLastChunk = "\r\n0\r\n\r\n";

}  // namespace kvrelay::proxy
