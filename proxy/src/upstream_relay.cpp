#include "kvrelay/proxy/upstream_relay.h"

#include <boost/asio/bind_executor.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/read_size.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/buffer_body.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/write.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <array>
#include <optional>
#include <span>

#include "kvrelay/proxy/relay_framing.h"

namespace kvrelay::proxy {

namespace asio = boost::asio;
namespace beast = boost::beast;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

// Body bytes decoded per client write at most.
constexpr std::size_t kRelayChunkBytes = 16 * 1024;
// One upstream read takes whatever the kernel holds up to this much: a whole small response, or
// every event of a stream that has arrived so far, in one recv (a fresh buffer would start at 512).
constexpr std::size_t kUpstreamReadBytes = 16 * 1024;

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

  // Everything runs on the client session's strand (upstream completions are bound to it: a
  // pooled connection keeps the executor of the session that opened it). The relay's operations
  // strictly alternate between the two sockets, so the strand serialises them and the watchdog.
  void start(beast::tcp_stream& client, std::function<void(bool)> done) override {
    client_ = &client;
    done_ = std::move(done);
    started_ = Clock::now();
    last_progress_ = started_;
    upstream_buffer_.reserve(kUpstreamReadBytes);
    watchdog_.emplace(client_->get_executor());
    arm_watchdog(started_ + timeout_);
    if (pool_) {
      if (auto pooled = pool_->take(upstream_.host, upstream_.port)) {
        upstream_socket_.emplace(std::move(*pooled));
        reused_connection_ = true;
        return send_request();
      }
    }
    connect();
  }

 private:
  // Runs `handler` on the client's strand whichever executor the upstream socket has.
  template <class Handler>
  auto on_strand(Handler&& handler) {
    return asio::bind_executor(client_->get_executor(), std::forward<Handler>(handler));
  }

  // One timer per relay instead of one per socket operation: each completed read or write only
  // records the time, and the timer, when it fires, re-arms for what is left of the deadline or
  // cancels the stalled operation. Every wait, connect, read or write thus still has `timeout_`.
  void arm_watchdog(Clock::time_point deadline) {
    watchdog_->expires_at(deadline);
    watchdog_->async_wait([self = shared_from_this()](beast::error_code ec) { self->on_watchdog(ec); });
  }

  void on_watchdog(beast::error_code ec) {
    if (ec || finished_) return;
    const auto deadline = last_progress_ + timeout_;
    if (Clock::now() < deadline) return arm_watchdog(deadline);
    timed_out_ = true;
    beast::error_code ignored;
    if (resolver_) resolver_->cancel();
    if (upstream_socket_) upstream_socket_->cancel(ignored);
    client_->socket().cancel(ignored);
  }

  // A completion that raced the watchdog counts as timed out: the relay is being cut.
  void note_progress(beast::error_code& ec) {
    if (timed_out_) {
      ec = beast::error::timeout;
      return;
    }
    last_progress_ = Clock::now();
  }

  void connect() {
    reused_connection_ = false;
    upstream_socket_.emplace(client_->get_executor());
    beast::error_code parse_ec;
    const auto address = asio::ip::make_address(upstream_.host, parse_ec);
    if (!parse_ec) {  // IP literal: no resolver round trip (Asio resolves on a helper thread)
      return upstream_socket_->async_connect(tcp::endpoint(address, upstream_.port),
                                             [self = shared_from_this()](beast::error_code ec) {
                                               self->note_progress(ec);
                                               self->on_connected(ec);
                                             });
    }
    resolver_.emplace(client_->get_executor());
    resolver_->async_resolve(
        upstream_.host, std::to_string(upstream_.port),
        [self = shared_from_this()](beast::error_code ec, const tcp::resolver::results_type& results) {
          self->note_progress(ec);
          if (ec) return self->fail_before_response("connect", ec);
          asio::async_connect(*self->upstream_socket_, results,
                              [self](beast::error_code connect_ec, const tcp::endpoint&) {
                                self->note_progress(connect_ec);
                                self->on_connected(connect_ec);
                              });
        });
  }

  void on_connected(beast::error_code ec) {
    if (ec) return fail_before_response("connect", ec);
    beast::error_code option_ec;
    upstream_socket_->set_option(tcp::no_delay(true), option_ec);
    send_request();
  }

  void send_request() {
    http::async_write(*upstream_socket_, request_,
                      on_strand([self = shared_from_this()](beast::error_code ec, std::size_t) {
                        self->note_progress(ec);
                        if (ec) return self->retry_or_fail("write", ec);
                        self->read_header();
                      }));
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
    http::async_read_header(*upstream_socket_, upstream_buffer_, *parser_,
                            on_strand([self = shared_from_this()](beast::error_code ec, std::size_t) {
                              self->note_progress(ec);
                              if (ec) return self->retry_or_fail("read", ec);
                              self->outcome_.time_to_first_byte = Clock::now() - self->started_;
                              self->prepare_header();
                            }));
  }

  // The response header is not written on its own: it goes out with the first body bytes in one
  // gathered write (one syscall and one segment instead of two per response). A client of an
  // event stream sees headers when the first event is ready, which is when it can act anyway.
  void prepare_header() {
    const auto& upstream_header = parser_->get();
    outcome_.status = upstream_header.result_int();
    RelayFraming framing = RelayFraming::kContentLength;
    std::uint64_t content_length = 0;
    if (const auto length = parser_->content_length()) {
      content_length = *length;
    } else if (parser_->chunked() || !parser_->is_done()) {
      framing = RelayFraming::kChunked;
    }
    chunked_ = framing == RelayFraming::kChunked;
    header_ = relayed_response_header(upstream_header.base(), framing, content_length, client_keep_alive_);
    relay_body();
  }

  // Forwards what the read buffer already holds; reads from the upstream only when it holds no
  // body byte (an event is forwarded as soon as it has arrived, never held for the next).
  void relay_body() {
    beast::error_code ec;
    const std::size_t bytes = parse_buffered(ec);
    if (ec) return fail_mid_stream("read", ec);
    if (bytes > 0 || parser_->is_done()) return write_to_client(bytes);
    read_upstream();
  }

  void read_upstream() {
    upstream_socket_->async_read_some(
        upstream_buffer_.prepare(beast::read_size(upstream_buffer_, kUpstreamReadBytes)),
        on_strand([self = shared_from_this()](beast::error_code ec, std::size_t received) {
          self->note_progress(ec);
          self->upstream_buffer_.commit(received);
          // A body without length or chunking ends when the upstream closes.
          if (ec == asio::error::eof) self->parser_->put_eof(ec);
          if (ec) return self->fail_mid_stream("read", ec);
          self->relay_body();
        }));
  }

  // Decodes buffered body bytes (undoing the upstream's chunking) into chunk_: several events
  // that arrived in one segment cost one client write, not one each.
  std::size_t parse_buffered(beast::error_code& ec) {
    auto& body = parser_->get().body();
    std::size_t received = 0;
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

  // Header (the first time), chunk framing and body bytes leave in one gathered write.
  void write_to_client(std::size_t bytes) {
    const bool last = parser_->is_done();
    std::size_t count = 0;
    if (!header_sent_) client_buffers_[count++] = asio::buffer(header_);
    if (bytes > 0) {
      if (chunked_) client_buffers_[count++] = asio::buffer(format_chunk_size_line(bytes, chunk_size_line_));
      client_buffers_[count++] = asio::buffer(chunk_.data(), bytes);
      if (chunked_) client_buffers_[count++] = asio::buffer(last ? kChunkEndAndLastChunk : kChunkEnd);
    } else if (last && chunked_) {
      client_buffers_[count++] = asio::buffer(kLastChunk);
    }
    header_sent_ = true;
    if (bytes > 0 && outcome_.response_bytes == 0) outcome_.time_to_first_body_byte = Clock::now() - started_;
    outcome_.response_bytes += bytes;
    if (keep_tail_bytes_ > 0 && bytes > 0) keep_tail(bytes);
    if (count == 0) return finish(client_keep_alive_);  // content-length body already complete
    asio::async_write(client_->socket(), std::span<const asio::const_buffer>(client_buffers_.data(), count),
                      [self = shared_from_this(), last](beast::error_code ec, std::size_t) {
                        self->note_progress(ec);
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
    // The error response gets a deadline of its own (the watchdog may just have cut the upstream).
    timed_out_ = false;
    last_progress_ = Clock::now();
    arm_watchdog(last_progress_ + timeout_);
    header_sent_ = true;
    http::async_write(client_->socket(), error_response_,
                      [self = shared_from_this()](beast::error_code write_ec, std::size_t) {
                        self->note_progress(write_ec);
                        if (write_ec) return self->finish_client_error(write_ec);
                        self->finish(self->client_keep_alive_);
                      });
  }

  void fail_mid_stream(const char* kind, beast::error_code ec) {
    // Before the header went out the client can still be told what happened.
    if (!header_sent_) return fail_before_response(kind, ec);
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
    finished_ = true;
    watchdog_->cancel();
    outcome_.total = Clock::now() - started_;
    if (upstream_socket_) {
      const bool reusable = pool_ && parser_ && parser_->is_done() && parser_->keep_alive() &&
                            upstream_buffer_.size() == 0 && upstream_socket_->is_open() && !outcome_.upstream_failed;
      if (reusable) {
        pool_->give_back(upstream_.host, upstream_.port, std::move(*upstream_socket_));
      } else {
        beast::error_code ignored;
        upstream_socket_->shutdown(tcp::socket::shutdown_both, ignored);
        upstream_socket_->close(ignored);
      }
      upstream_socket_.reset();
    }
    if (on_finished_) on_finished_(outcome_);
    auto done = std::move(done_);
    done(keep_alive);
  }

  std::size_t keep_tail_bytes_;
  std::shared_ptr<UpstreamPool> pool_;
  std::optional<tcp::resolver> resolver_;
  std::optional<tcp::socket> upstream_socket_;
  HttpUrl upstream_;
  HttpRequest request_;
  bool client_keep_alive_;
  std::chrono::milliseconds timeout_;
  std::function<void(const RelayOutcome&)> on_finished_;
  beast::tcp_stream* client_ = nullptr;
  std::function<void(bool)> done_;
  std::optional<asio::steady_timer> watchdog_;
  Clock::time_point started_;
  Clock::time_point last_progress_;
  bool timed_out_ = false;
  bool finished_ = false;
  beast::flat_buffer upstream_buffer_;
  std::optional<http::response_parser<http::buffer_body>> parser_;
  std::string header_;
  bool header_sent_ = false;
  bool chunked_ = false;
  ChunkSizeLine chunk_size_line_{};
  std::array<asio::const_buffer, 4> client_buffers_;
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
