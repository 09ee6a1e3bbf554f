#pragma once

#include <boost/beast/core/tcp_stream.hpp>

#include <functional>
#include <memory>
#include <variant>

#include "kvrelay/proxy/http_types.h"

namespace kvrelay::proxy {

// A response produced asynchronously and streamed to the client as it is produced (the front
// proxy's upstream relay). The HTTP session hands over its stream once every earlier pipelined
// response has been written, and reads nothing more until `done` is called.
class StreamingResponder {
 public:
  virtual ~StreamingResponder() = default;
  // Writes one complete HTTP response to `client`, then calls `done` exactly once; keep_alive
  // false tells the session to close the connection (the response could not be completed).
  virtual void start(boost::beast::tcp_stream& client, std::function<void(bool keep_alive)> done) = 0;
};

using Reply = std::variant<HttpResponse, std::shared_ptr<StreamingResponder>>;

// What the HTTP server calls for every parsed request.
using Dispatcher = std::function<Reply(HttpRequest&& request)>;

}  // namespace kvrelay::proxy
