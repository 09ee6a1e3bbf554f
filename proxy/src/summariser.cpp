#include "summariser.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/write.hpp>
#include <fmt/format.h>

#include <utility>

namespace kvrelay::proxy {

namespace summariser_detail {

namespace asio = boost::asio;
namespace beast = boost::beast;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

// One request on a connection of its own (closed after the answer), under one deadline that a
// timer enforces by cancelling whatever operation is pending.
class SummariserClient final : public std::enable_shared_from_this<SummariserClient> {
 public:
  SummariserClient(const asio::any_io_executor& executor, SummariserCall call, SummariserDone done)
      : socket_(executor), resolver_(executor), timer_(executor), call_(std::move(call)), done_(std::move(done)) {}

  void start() {
    request_ = HttpRequest{http::verb::post, call_.endpoint.base_path + "/v1/completions", 11};
    request_.set(http::field::host, fmt::format("{}:{}", call_.endpoint.host, call_.endpoint.port));
    request_.set(http::field::content_type, "application/json");
    request_.set(http::field::accept, "application/json");
    request_.keep_alive(false);
    request_.body() = std::move(call_.body);
    request_.prepare_payload();
    parser_.body_limit(call_.max_response_bytes);
    timer_.expires_after(call_.timeout);
    timer_.async_wait([self = shared_from_this()](beast::error_code ec) {
      if (ec || self->finished_) return;
      self->timed_out_ = true;
      beast::error_code ignored;
      self->resolver_.cancel();
      self->socket_.cancel(ignored);
    });
    beast::error_code parse_ec;
    const auto address = asio::ip::make_address(call_.endpoint.host, parse_ec);
    if (!parse_ec) {
      return socket_.async_connect(tcp::endpoint(address, call_.endpoint.port),
                                   [self = shared_from_this()](beast::error_code ec) { self->on_connected(ec); });
    }
    resolver_.async_resolve(
        call_.endpoint.host, std::to_string(call_.endpoint.port),
        [self = shared_from_this()](beast::error_code ec, const tcp::resolver::results_type& found) {
          if (ec) return self->finish_error("resolve", ec);
          asio::async_connect(self->socket_, found, [self](beast::error_code connect_ec, const tcp::endpoint&) {
            self->on_connected(connect_ec);
          });
        });
  }

 private:
  void on_connected(beast::error_code ec) {
    if (ec) return finish_error("connect", ec);
    beast::error_code ignored;
    socket_.set_option(tcp::no_delay(true), ignored);
    http::async_write(socket_, request_, [self = shared_from_this()](beast::error_code write_ec, std::size_t) {
      if (write_ec) return self->finish_error("write", write_ec);
      http::async_read(self->socket_, self->buffer_, self->parser_,
                       [self](beast::error_code read_ec, std::size_t) { self->on_read(read_ec); });
    });
  }

  void on_read(beast::error_code ec) {
    if (ec == http::error::body_limit) {
      return finish(fail(ErrorCode::kResourceExhausted,
                         fmt::format("the summariser's answer exceeds {} bytes", call_.max_response_bytes)));
    }
    if (ec) return finish_error("read", ec);
    auto& response = parser_.get();
    finish(SummariserResponse{response.result_int(), std::move(response.body())});
  }

  void finish_error(const char* step, beast::error_code ec) {
    if (timed_out_) {
      return finish(fail(ErrorCode::kTimeout, fmt::format("the summariser did not answer within {} ms (at {})",
                                                          call_.timeout.count(), step)));
    }
    finish(fail(ErrorCode::kIo, fmt::format("summariser {}:{}: {} failed: {}", call_.endpoint.host, call_.endpoint.port,
                                            step, ec.message())));
  }

  void finish(Result<SummariserResponse> result) {
    if (finished_) return;
    finished_ = true;
    timer_.cancel();
    beast::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    auto done = std::move(done_);
    done(std::move(result));
  }

  tcp::socket socket_;
  tcp::resolver resolver_;
  asio::steady_timer timer_;
  SummariserCall call_;
  SummariserDone done_;
  HttpRequest request_;
  beast::flat_buffer buffer_;
  http::response_parser<http::string_body> parser_;
  bool timed_out_ = false;
  bool finished_ = false;
};

class SummaryRelay final : public StreamingResponder, public std::enable_shared_from_this<SummaryRelay> {
 public:
  SummaryRelay(SummaryStep step, std::shared_ptr<UpstreamPool> pool, HttpUrl upstream, HttpRequest request,
               bool client_keep_alive, std::chrono::milliseconds timeout,
               std::function<void(const RelayOutcome&)> on_finished, std::size_t keep_tail_bytes)
      : step_(std::move(step)),
        pool_(std::move(pool)),
        upstream_(std::move(upstream)),
        request_(std::move(request)),
        client_keep_alive_(client_keep_alive),
        timeout_(timeout),
        on_finished_(std::move(on_finished)),
        keep_tail_bytes_(keep_tail_bytes) {}

  void start(beast::tcp_stream& client, std::function<void(bool)> done) override {
    const auto started = Clock::now();
    // The client's executor is its session's strand: the answer comes back on it, as the relay runs.
    call_summariser(client.get_executor(), std::move(step_.call),
                    [self = shared_from_this(), &client, done = std::move(done),
                     started](Result<SummariserResponse> answer) mutable {
                      self->relay(client, std::move(done), std::move(answer), Clock::now() - started);
                    });
  }

 private:
  void relay(beast::tcp_stream& client, std::function<void(bool)> done, Result<SummariserResponse> answer,
             Clock::duration waited) {
    if (auto body = step_.body_for_b(std::move(answer), waited)) {
      request_.body() = std::move(*body);
      request_.prepare_payload();
    }
    auto on_finished = [finished = std::move(on_finished_), waited](const RelayOutcome& relayed) {
      if (!finished) return;
      RelayOutcome outcome = relayed;
      outcome.time_to_first_byte += waited;
      outcome.time_to_first_body_byte += waited;
      outcome.total += waited;
      finished(outcome);
    };
    make_upstream_relay(std::move(pool_), std::move(upstream_), std::move(request_), client_keep_alive_, timeout_,
                        std::move(on_finished), keep_tail_bytes_)
        ->start(client, std::move(done));
  }

  SummaryStep step_;
  std::shared_ptr<UpstreamPool> pool_;
  HttpUrl upstream_;
  HttpRequest request_;
  bool client_keep_alive_;
  std::chrono::milliseconds timeout_;
  std::function<void(const RelayOutcome&)> on_finished_;
  std::size_t keep_tail_bytes_;
};

}  // namespace summariser_detail

void call_summariser(const boost::asio::any_io_executor& executor, SummariserCall call, SummariserDone done) {
  std::make_shared<summariser_detail::SummariserClient>(executor, std::move(call), std::move(done))->start();
}

std::shared_ptr<StreamingResponder> make_summary_relay(SummaryStep step, std::shared_ptr<UpstreamPool> pool,
                                                       HttpUrl upstream, HttpRequest request, bool client_keep_alive,
                                                       std::chrono::milliseconds timeout,
                                                       std::function<void(const RelayOutcome&)> on_finished,
                                                       std::size_t keep_tail_bytes) {
  return std::make_shared<summariser_detail::SummaryRelay>(std::move(step), std::move(pool), std::move(upstream),
                                                           std::move(request), client_keep_alive, timeout,
                                                           std::move(on_finished), keep_tail_bytes);
}

}  // namespace kvrelay::proxy
