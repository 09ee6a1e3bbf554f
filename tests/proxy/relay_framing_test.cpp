// The relay's hand-made framing must be what an HTTP parser reads back: same status, reason,
// end-to-end fields and body, no hop-by-hop fields, this hop's framing.
#include "kvrelay/proxy/relay_framing.h"

#include <boost/beast/core/buffers_to_string.hpp>
#include <boost/beast/http/parser.hpp>
#include <catch2/catch.hpp>

#include <string>
#include <vector>

using namespace kvrelay::proxy;

namespace {

http::response_header<> upstream_event_stream_header() {
  http::response_header<> header;
  header.result(http::status::ok);
  header.reason("Streaming Along");
  header.set(http::field::content_type, "text/event-stream");
  header.set(http::field::connection, "keep-alive");
  header.set(http::field::transfer_encoding, "chunked");
  header.set(http::field::keep_alive, "timeout=5");
  header.set("X-Request-Id", "req-7");
  header.insert("X-Repeated", "one");
  header.insert("X-Repeated", "two");
  return header;
}

// Frames `events` as the relay does: the header with the first write, one chunk per write.
std::string chunked_relay_bytes(const std::vector<std::string>& events, bool keep_alive) {
  std::string wire = relayed_response_header(upstream_event_stream_header(), RelayFraming::kChunked, 0, keep_alive);
  ChunkSizeLine line{};
  for (std::size_t index = 0; index < events.size(); ++index) {
    wire += format_chunk_size_line(events[index].size(), line);
    wire += events[index];
    wire += index + 1 == events.size() ? kChunkEndAndLastChunk : kChunkEnd;
  }
  return wire;
}

http::response<http::string_body> parse_whole(const std::string& wire) {
  http::response_parser<http::string_body> parser;
  boost::beast::error_code ec;
  std::size_t consumed = 0;
  while (!parser.is_done() && consumed < wire.size()) {
    const auto used = parser.put(boost::asio::buffer(wire.data() + consumed, wire.size() - consumed), ec);
    REQUIRE_FALSE(ec);
    REQUIRE(used > 0);
    consumed += used;
  }
  REQUIRE(parser.is_done());
  CHECK(consumed == wire.size());  // nothing after the message
  return parser.release();
}

}  // namespace

TEST_CASE("relayed chunked events parse back to the upstream's body and end-to-end fields", "[proxy][relay]") {
  std::vector<std::string> events;
  std::string body;
  for (int index = 0; index < 40; ++index) {
    // Sizes that need one, two and three hex digits.
    events.push_back("data: {\"token\":" + std::to_string(index) + "," +
                     std::string(static_cast<std::size_t>(index * 97), 'x') + "}\n\n");
    body += events.back();
  }
  const auto response = parse_whole(chunked_relay_bytes(events, true));
  CHECK(response.result_int() == 200);
  CHECK(response.reason() == "Streaming Along");
  CHECK(response.version() == 11);
  CHECK(response.body() == body);
  CHECK(response[http::field::content_type] == "text/event-stream");
  CHECK(response["X-Request-Id"] == "req-7");
  CHECK(std::distance(response.equal_range("X-Repeated").first, response.equal_range("X-Repeated").second) == 2);
  CHECK(response.count(http::field::keep_alive) == 0);
  CHECK(response.count(http::field::connection) == 0);
  CHECK(response.chunked());
  CHECK(response.keep_alive());
}

TEST_CASE("relayed header carries the upstream's length, or Connection: close when the client goes", "[proxy][relay]") {
  auto upstream = upstream_event_stream_header();
  upstream.erase(http::field::transfer_encoding);
  upstream.set(http::field::content_length, "999");  // replaced by the length the relay was given
  const std::string body = R"({"choices":[{"text":"hello"}]})";
  const auto wire = relayed_response_header(upstream, RelayFraming::kContentLength, body.size(), false) + body;
  const auto response = parse_whole(wire);
  CHECK(response.body() == body);
  CHECK(response[http::field::content_length] == std::to_string(body.size()));
  CHECK(response.count(http::field::content_length) == 1);
  CHECK_FALSE(response.chunked());
  CHECK_FALSE(response.keep_alive());
}

TEST_CASE("chunk size lines are lower-case hex with CRLF for any size", "[proxy][relay]") {
  ChunkSizeLine line{};
  CHECK(format_chunk_size_line(1, line) == "1\r\n");
  CHECK(format_chunk_size_line(0x3fa, line) == "3fa\r\n");
  CHECK(format_chunk_size_line(16 * 1024, line) == "4000\r\n");
  CHECK(format_chunk_size_line(SIZE_MAX, line) == "ffffffffffffffff\r\n");
}
