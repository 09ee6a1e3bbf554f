#include "kvrelay/proxy/upstream_relay.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/buffer_body.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/serializer.hpp>
#include <boost/beast/http/write.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <array>
#include <optional>

namespace kvrelay::proxy {

namespace asio = boost::asio;
namespace beast = boost::beast;
using tcp = asio::ip::tcp;

namespace {

constexpr std::size_t kRelayChunkBytes = 16 * 1024;

class UpstreamRelay final : public StreamingResponder, public std::enable_shared_from_this<UpstreamRelay> {
 public:
  UpstreamRelay(std::shared_ptr<UpstreamPool> pool, HttpUrl upstream, HttpRequest request, bool client_keep_alive,
                std::chrono::milliseconds timeout, std::function<void(const RelayOutcome&)> on_finished,
                std::size_t keep_tail_bytes)
      : keep_tail_bytes_(keep_tail_bytes),
        pool_(std::move(pool)),
        upstream_(std::move(upstream)),
        request_(std::move(request)),
        client_keep_alive_(client_keep_alive),
        timeout_(timeout),
        on_finished_(std::move(on_finished)) {}

  // Everything runs on the client session's strand: the relay's operations strictly alternate
  // between the two sockets, so one strand serialises them without extra synchronisation.
  void start(beast::tcp_stream& client, std::function<void(bool)> done) override {
    client_ = &client;
    done_ = std::move(done);
    started_ = std::chrono::steady_clock::now();
    if (pool_) {
      if (auto pooled = pool_->take(upstream_.host, upstream_.port)) {
        upstream_stream_.emplace(std::move(*pooled));
        reused_connection_ = true;
        return send_request();
      }
    }
    connect();
  }

 private:
  void connect() {
    reused_connection_ = false;
    upstream_stream_.emplace(client_->get_executor());
    upstream_stream_->expires_after(timeout_);
    beast::error_code parse_ec;
    const auto address = asio::ip::make_address(upstream_.host, parse_ec);
    if (!parse_ec) {  // IP literal: no resolver round trip (Asio resolves on a helper thread)
      return upstream_stream_->async_connect(
          tcp::endpoint(address, upstream_.port),
          [self = shared_from_this()](beast::error_code ec) { self->on_connected(ec); });
    }
    resolver_.emplace(client_->get_executor());
    resolver_->async_resolve(
        upstream_.host, std::to_string(upstream_.port),
        [self = shared_from_this()](beast::error_code ec, tcp::resolver::results_type results) {
          if (ec) return self->fail_before_response("connect", ec);
          self->upstream_stream_->async_connect(
              results, [self](beast::error_code connect_ec, const tcp::endpoint&) { self->on_connected(connect_ec); });
        });
  }

  void on_connected(beast::error_code ec) {
    if (ec) return fail_before_response("connect", ec);
    beast::error_code option_ec;
    upstream_stream_->socket().set_option(tcp::no_delay(true), option_ec);
    send_request();
  }

  void send_request() {
    upstream_stream_->expires_after(timeout_);
    http::async_write(*upstream_stream_, request_, [self = shared_from_this()](beast::error_code ec, std::size_t) {
      if (ec) return self->retry_or_fail("write", ec);
      self->read_header();
    });
  }

  // A pooled connection can have been closed by the upstream just as it was taken; the request
  // is repeated once on a fresh connection as long as no response byte has arrived.
  void retry_or_fail(const char* kind, beast::error_code ec) {
    if (reused_connection_ && ec != beast::error::timeout) {
      upstream_buffer_.clear();
      return connect();
    }
    fail_before_response(kind, ec);
  }

  void read_header() {
    parser_.emplace();
    parser_->body_limit(boost::none);  // the upstream is trusted to bound its own responses
    http::async_read_header(*upstream_stream_, upstream_buffer_, *parser_,
                            [self = shared_from_this()](beast::error_code ec, std::size_t) {
                              if (ec) return self->retry_or_fail("read", ec);
                              self->outcome_.time_to_first_byte = std::chrono::steady_clock::now() - self->started_;
                              self->prepare_header();
                            });
  }

  // The response header is not written on its own: it goes out with the first body bytes in one
  // gathered write (one syscall and one segment instead of two per response). A client of an
  // event stream sees headers when the first event is ready, which is when it can act anyway.
  void prepare_header() {
    const auto& upstream_header = parser_->get();
    response_.result(upstream_header.result_int());
    response_.version(11);
    for (const auto& field : upstream_header) {
      if (!is_hop_by_hop(field.name())) response_.insert(field.name_string(), field.value());
    }
    outcome_.status = upstream_header.result_int();
    if (const auto length = parser_->content_length()) {
      response_.content_length(*length);
    } else if (parser_->chunked() || !parser_->is_done()) {
      response_.chunked(true);
    } else {
      response_.content_length(0);
    }
    response_.keep_alive(client_keep_alive_);
    response_.body().data = nullptr;
    response_.body().more = true;
    serializer_.emplace(response_);
    relay_body();
  }

  void relay_body() {
    if (parser_->is_done()) return write_body_chunk(0);
    parser_->get().body().data = chunk_.data();
    parser_->get().body().size = chunk_.size();
    upstream_stream_->expires_after(timeout_);
    http::async_read_some(
        *upstream_stream_, upstream_buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, std::size_t) {
          if (ec == http::error::need_buffer) ec = {};
          if (ec) return self->fail_mid_stream("read", ec);
          const std::size_t received = self->drain_buffered(self->chunk_.size() - self->parser_->get().body().size, ec);
          if (ec) return self->fail_mid_stream("read", ec);
          self->write_body_chunk(received);
        });
  }

  // Body bytes that already sit in the read buffer (several events of a stream arriving in one
  // segment) are parsed into the same outgoing chunk, so they cost one client write, not one each.
  std::size_t drain_buffered(std::size_t received, beast::error_code& ec) {
    auto& body = parser_->get().body();
    while (!parser_->is_done() && upstream_buffer_.size() > 0 && received < chunk_.size()) {
      body.data = chunk_.data() + received;
      body.size = chunk_.size() - received;
      const std::size_t consumed = parser_->put(upstream_buffer_.data(), ec);
      upstream_buffer_.consume(consumed);
      received = chunk_.size() - body.size;
      // need_more: the rest of a chunk header or event is still in flight; the next read brings it.
      if (ec == http::error::need_buffer || ec == http::error::need_more) ec = {};
      if (ec || consumed == 0) break;
    }
    return received;
  }

  void write_body_chunk(std::size_t bytes) {
    const bool last = parser_->is_done();
    if (bytes == 0 && !last) return relay_body();  // the parser consumed framing only
    response_.body().data = bytes == 0 ? nullptr : chunk_.data();
    response_.body().size = bytes;
    response_.body().more = !last;
    if (bytes > 0 && outcome_.response_bytes == 0) {
      outcome_.time_to_first_body_byte = std::chrono::steady_clock::now() - started_;
    }
    outcome_.response_bytes += bytes;
    if (keep_tail_bytes_ > 0 && bytes > 0) keep_tail(bytes);
    client_->expires_after(timeout_);
    http::async_write(*client_, *serializer_, [self = shared_from_this(), last](beast::error_code ec, std::size_t) {
      if (ec == http::error::need_buffer) ec = {};
      if (ec) return self->finish_client_error(ec);
      if (last) return self->finish(self->client_keep_alive_);
      self->relay_body();
    });
  }

  void keep_tail(std::size_t bytes) {
    auto& tail = outcome_.body_tail;
    tail.append(chunk_.data(), bytes);
    if (tail.size() > keep_tail_bytes_) tail.erase(0, tail.size() - keep_tail_bytes_);
  }

  void fail_before_response(const char* kind, beast::error_code ec) {
    const bool timed_out = ec == beast::error::timeout;
    outcome_.upstream_failed = true;
    outcome_.error_kind = timed_out ? "timeout" : kind;
    const auto status = timed_out ? http::status::gateway_timeout : http::status::bad_gateway;
    outcome_.status = static_cast<unsigned>(status);
    spdlog::warn("upstream {}:{}: {} failed: {}", upstream_.host, upstream_.port, kind, ec.message());
    error_response_ = make_json_error(status, "upstream_error",
                                      fmt::format("upstream {}:{} {} failed: {}", upstream_.host, upstream_.port,
                                                  timed_out ? "timed out;" : kind, ec.message()),
                                      11, client_keep_alive_);
    client_->expires_after(timeout_);
    http::async_write(*client_, error_response_, [self = shared_from_this()](beast::error_code write_ec, std::size_t) {
      if (write_ec) return self->finish_client_error(write_ec);
      self->finish(self->client_keep_alive_);
    });
  }

  void fail_mid_stream(const char* kind, beast::error_code ec) {
    // Headers already went out: the only honest signal left is closing the connection.
    outcome_.upstream_failed = true;
    outcome_.error_kind = ec == beast::error::timeout ? "timeout" : kind;
    spdlog::warn("upstream {}:{}: {} failed mid-response: {}", upstream_.host, upstream_.port, kind, ec.message());
    finish(false);
  }

  void finish_client_error(beast::error_code ec) {
    spdlog::debug("client went away during relay: {}", ec.message());
    if (!outcome_.upstream_failed) outcome_.error_kind = "client";
    finish(false);
  }

  void finish(bool keep_alive) {
    outcome_.total = std::chrono::steady_clock::now() - started_;
    if (upstream_stream_) {
      const bool reusable = pool_ && parser_ && parser_->is_done() && parser_->keep_alive() &&
                            upstream_buffer_.size() == 0 && upstream_stream_->socket().is_open();
      if (reusable) {
        upstream_stream_->expires_never();
        pool_->give_back(upstream_.host, upstream_.port, upstream_stream_->release_socket());
      } else {
        beast::error_code ignored;
        upstream_stream_->socket().shutdown(tcp::socket::shutdown_both, ignored);
        upstream_stream_->close();
      }
    }
    if (on_finished_) on_finished_(outcome_);
    auto done = std::move(done_);
    done(keep_alive);
  }

  std::size_t keep_tail_bytes_;
  std::shared_ptr<UpstreamPool> pool_;
  std::optional<tcp::resolver> resolver_;
  std::optional<beast::tcp_stream> upstream_stream_;
  HttpUrl upstream_;
  HttpRequest request_;
  bool client_keep_alive_;
  std::chrono::milliseconds timeout_;
  std::function<void(const RelayOutcome&)> on_finished_;
  beast::tcp_stream* client_ = nullptr;
  std::function<void(bool)> done_;
  std::chrono::steady_clock::time_point started_;
  beast::flat_buffer upstream_buffer_;
  std::optional<http::response_parser<http::buffer_body>> parser_;
  http::response<http::buffer_body> response_;
  std::optional<http::response_serializer<http::buffer_body>> serializer_;
  HttpResponse error_response_;
  std::array<char, kRelayChunkBytes> chunk_;  // not value-initialised: filled before every use
  bool reused_connection_ = false;
  RelayOutcome outcome_;
};

}  // namespace

std::shared_ptr<StreamingResponder> make_upstream_relay(std::shared_ptr<UpstreamPool> pool, HttpUrl upstream,
                                                        HttpRequest request, bool client_keep_alive,
                                                        std::chrono::milliseconds timeout,
                                                        std::function<void(const RelayOutcome&)> on_finished,
                                                        std::size_t keep_tail_bytes) {
  return std::make_shared<UpstreamRelay>(std::move(pool), std::move(upstream), std::move(request), client_keep_alive,
                                         timeout, std::move(on_finished), keep_tail_bytes);
}

}  // namespace kvrelay::proxy
