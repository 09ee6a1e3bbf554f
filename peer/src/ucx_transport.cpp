#include "kvrelay/peer/ucx_transport.h"

// GCC 12 reports a false -Wmismatched-new-delete for Asio's coroutine frame allocator
// (awaitable_frame_base has matching class-level new/delete).
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include <poll.h>
#include <unistd.h>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/experimental/concurrent_channel.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <openssl/rand.h>
#include <sstream>
#include <unordered_map>

#if KVRELAY_HAVE_UCX
#include <ucp/api/ucp.h>
#endif

namespace kvrelay::peer {

namespace asio = boost::asio;

bool ucx_built() noexcept {
#if KVRELAY_HAVE_UCX
  return true;
#else
  return false;
#endif
}

#if KVRELAY_HAVE_UCX

namespace {

// Active message ids. Every message is sent with UCP_AM_SEND_FLAG_REPLY, so the receiver learns
// which endpoint it came from and can hold that endpoint to the token it presented.
constexpr unsigned kAmAuth = 1;    // header: the token. The first message on an endpoint.
constexpr unsigned kAmAuthOk = 2;  // header: the token. The answer, on the bound endpoint.
constexpr unsigned kAmChunk = 3;   // header: the 20-byte chunk header; data: the chunk's body
// Events a link may hold before its consumer takes them: arrivals are bounded by the stream's
// window (at most kMaxWindowChunks), the rest by one per kind outstanding.
constexpr std::size_t kEventCapacity = 2 * kMaxWindowChunks + 16;
using EventChannel = asio::experimental::concurrent_channel<void(boost::system::error_code, UcxEvent)>;

Error ucx_failure(std::string_view what, ucs_status_t status) {
  return Error{ErrorCode::kIo, fmt::format("UCX {}: {}", what, ucs_status_string(status))};
}

}  // namespace

struct UcxContext::Impl {
  ucp_context_h context = nullptr;
  struct Region {
    const std::byte* data = nullptr;
    std::size_t bytes = 0;
    ucp_mem_h memh = nullptr;
  };
  std::mutex mutex;
  std::vector<Region> regions;

  // The registration covering [data, data + bytes), or none.
  ucp_mem_h registered(const void* data, std::size_t bytes) {
    const auto* begin = static_cast<const std::byte*>(data);
    const std::lock_guard lock(mutex);
    for (const auto& region : regions) {
      if (begin >= region.data && begin + bytes <= region.data + region.bytes) return region.memh;
    }
    return nullptr;
  }
  ~Impl() {
    for (const auto& region : regions)
      ucp_mem_unmap(context, region.memh);
    if (context != nullptr) ucp_cleanup(context);
  }
};

struct UcxLink::Impl {
  Impl(std::shared_ptr<UcxWorker::Impl> owner, const UcxToken& issued, const asio::any_io_executor& executor)
      : worker(std::move(owner)), token(issued), events(executor, kEventCapacity) {}
  ~Impl();
  void emit(UcxEvent event) {
    if (!events.try_send(boost::system::error_code{}, std::move(event))) {
      // Full: the peer sent more than its window allows. The consumer learns it from kFailed
      // only if there is room, so close: next_event then fails once the queue is read.
      {
        const std::lock_guard lock(mutex);
        if (failure.empty()) failure = "more events than a stream's window allows";
      }
      events.close();
    }
  }
  void fail(std::string message) {
    {
      const std::lock_guard lock(mutex);
      if (failure.empty()) failure = message;
    }
    failed.store(true);
    UcxEvent event;
    event.kind = UcxEvent::Kind::kFailed;
    event.message = std::move(message);
    emit(std::move(event));
  }
  // "UCX link closed", with the failure that closed it when there was one.
  [[nodiscard]] std::string why_down() {
    const std::lock_guard lock(mutex);
    return failure.empty() ? std::string("UCX link closed") : "UCX link failed: " + failure;
  }
  std::shared_ptr<UcxWorker::Impl> worker;
  const UcxToken token;
  EventChannel events;
  std::mutex mutex;       // guards ep and failure
  std::string failure;    // why the link failed: the first reason reported
  ucp_ep_h ep = nullptr;  // where this link sends: dialled here, with peer error handling
  bool answerer = false;  // server side: answers the token the peer presents (else presents it)
  std::atomic<bool> ready{false};
  std::atomic<bool> failed{false};
  std::atomic<bool> closed{false};
  std::atomic<std::size_t> sends{0};
};

struct UcxWorker::Impl : std::enable_shared_from_this<UcxWorker::Impl> {
  std::shared_ptr<UcxContext> context;
  ucp_worker_h worker = nullptr;
  asio::any_io_executor executor;
  std::unique_ptr<asio::posix::stream_descriptor> wakeup;  // a dup of the worker's event fd
  std::vector<std::byte> address;

  std::mutex mutex;
  std::map<UcxToken, std::weak_ptr<UcxLink::Impl>> tokens;  // issued or dialled, not yet answered
  // Endpoint a message came from -> its link. A closed link's endpoint stays (expired): messages
  // it sent before the close still arrive, and are dropped, never answered by a second close.
  std::unordered_map<ucp_ep_h, std::weak_ptr<UcxLink::Impl>> bound;
  std::vector<ucp_ep_h> refused;                        // closed after this progress pass
  std::vector<void*> closing;                           // close requests not yet complete
  std::vector<std::shared_ptr<UcxLink::Impl>> answers;  // AuthOk to send after this pass
  std::atomic<bool> kick_posted{false};
  std::atomic<bool> stopping{false};
  std::atomic<std::uint64_t> refused_count{0};
  std::function<void()> on_refused;  // set before the worker progresses

  ~Impl() {
    wakeup.reset();
    if (worker == nullptr) return;
    // Closes still pending (forced ones finish locally, within a few passes) end before the worker.
    for (int pass = 0; pass < 10'000; ++pass) {
      {
        const std::lock_guard lock(mutex);
        if (closing.empty()) break;
      }
      ucp_worker_progress(worker);
      reap_closes(false);
    }
    reap_closes(true);
    ucp_worker_destroy(worker);
  }

  // Progress until the worker is armed: the event fd then wakes us for anything new.
  void progress() {
    for (int round = 0; round < 1'000'000; ++round) {
      while (ucp_worker_progress(worker) != 0) {
      }
      run_deferred();
      const ucs_status_t armed = ucp_worker_arm(worker);
      if (armed == UCS_ERR_BUSY) continue;
      if (armed != UCS_OK) spdlog::warn("UCX worker arm: {}", ucs_status_string(armed));
      return;
    }
  }
  // After posting an operation from another coroutine: one progress pass on the worker's
  // executor (coalesced), since the operation may need it before any fd event.
  void kick() {
    if (kick_posted.exchange(true)) return;
    asio::post(executor, [self = shared_from_this()] {
      self->kick_posted.store(false);
      if (!self->stopping.load()) self->progress();
    });
  }
  void run_deferred();
  // Forced close of an endpoint of ours or a refused one; its request is reaped by progress.
  void close_endpoint(ucp_ep_h ep);
  // Frees the close requests that completed (all of them when `all`).
  void reap_closes(bool all);
  // The link `ep` is bound to; `retired` when it was bound to one that is gone.
  std::shared_ptr<UcxLink::Impl> link_of(ucp_ep_h ep, bool& retired) {
    const std::lock_guard lock(mutex);
    const auto found = bound.find(ep);
    retired = found != bound.end();
    auto link = retired ? found->second.lock() : nullptr;
    if (link && link->closed.load()) link.reset();
    retired = retired && !link;
    return link;
  }
  // Retired endpoints are kept for messages in flight at their close; past a few thousand the
  // oldest closes are long done. Under `mutex`.
  void forget_retired() {
    if (bound.size() < 4096) return;
    std::erase_if(bound, [](const auto& entry) { return entry.second.expired(); });
  }
  void refuse(ucp_ep_h ep, std::string_view why) {
    refused_count.fetch_add(1);
    if (on_refused) on_refused();
    spdlog::warn("UCX: active message refused ({}); its endpoint is closed", why);
    if (ep == nullptr) return;
    const std::lock_guard lock(mutex);
    refused.push_back(ep);
  }
};

namespace {

struct SendOp {
  std::array<std::byte, std::max(kChunkHeaderBytes, kUcxTokenBytes)> header{};
  std::size_t header_bytes = 0;
  std::shared_ptr<UcxLink::Impl> link;  // none for control answers
};

void finish_send(SendOp* op, ucs_status_t status) {
  if (op->link) {
    if (status != UCS_OK && status != UCS_ERR_CANCELED) op->link->fail(ucx_failure("send", status).message);
    if (op->link->sends.fetch_sub(1) == 1) {
      UcxEvent event;
      event.kind = UcxEvent::Kind::kSendsDone;
      op->link->emit(std::move(event));
    }
  }
  delete op;
}

void on_sent(void* request, ucs_status_t status, void* user_data) {
  finish_send(static_cast<SendOp*>(user_data), status);
  ucp_request_free(request);
}

// Posts an active message; `op` is the caller's until this returns, then UCX's or freed.
Status post_am(UcxWorker::Impl& worker, ucp_ep_h ep, unsigned id, SendOp* op, const void* body, std::size_t bytes) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = on_sent;
  param.user_data = op;
  param.flags = UCP_AM_SEND_FLAG_REPLY;
  if (bytes > 0) {
    if (ucp_mem_h memh = worker.context->impl().registered(body, bytes); memh != nullptr) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = memh;
    }
  }
  if (op->link) op->link->sends.fetch_add(1);
  const ucs_status_ptr_t request = ucp_am_send_nbx(ep, id, op->header.data(), op->header_bytes, body, bytes, &param);
  if (request == nullptr) {
    finish_send(op, UCS_OK);
    return ok();
  }
  if (UCS_PTR_IS_ERR(request)) {
    const ucs_status_t status = UCS_PTR_STATUS(request);
    if (op->link) op->link->sends.fetch_sub(1);
    delete op;
    return outcome::failure(ucx_failure("send", status));
  }
  worker.kick();
  return ok();
}

std::optional<UcxToken> token_of(const void* header, std::size_t length) {
  if (length != kUcxTokenBytes) return std::nullopt;
  UcxToken token{};
  std::memcpy(token.data(), header, kUcxTokenBytes);
  return token;
}

ucp_ep_h reply_endpoint(const ucp_am_recv_param_t* param) {
  return (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
}

// Server: the first message on an endpoint presents a token this worker issued.
ucs_status_t on_auth(void* arg, const void* header, std::size_t header_length, void* /*data*/, std::size_t length,
                     const ucp_am_recv_param_t* param) {
  auto* worker = static_cast<UcxWorker::Impl*>(arg);
  const ucp_ep_h ep = reply_endpoint(param);
  const auto token = token_of(header, header_length);
  if (ep == nullptr || !token || length != 0) {
    worker->refuse(ep, "a token message without a reply endpoint or of the wrong size");
    return UCS_OK;
  }
  std::shared_ptr<UcxLink::Impl> link;
  {
    const std::lock_guard lock(worker->mutex);
    if (const auto found = worker->tokens.find(*token); found != worker->tokens.end()) {
      link = found->second.lock();
      worker->tokens.erase(found);  // spent, whatever happens next
    }
    const auto earlier = worker->bound.find(ep);
    const bool taken = earlier != worker->bound.end() && !earlier->second.expired();
    if (link && link->answerer && !taken) {
      worker->forget_retired();
      worker->bound[ep] = link;
      worker->answers.push_back(link);
    } else {
      link.reset();
    }
  }
  if (!link) {
    worker->refuse(ep, "an unknown or spent token");
    return UCS_OK;
  }
  link->ready.store(true);
  return UCS_OK;
}

// Client: the peer answers the token on the endpoint it bound.
ucs_status_t on_auth_ok(void* arg, const void* header, std::size_t header_length, void* /*data*/, std::size_t length,
                        const ucp_am_recv_param_t* param) {
  auto* worker = static_cast<UcxWorker::Impl*>(arg);
  const ucp_ep_h ep = reply_endpoint(param);
  const auto token = token_of(header, header_length);
  std::shared_ptr<UcxLink::Impl> link;
  if (ep != nullptr && token && length == 0) {
    const std::lock_guard lock(worker->mutex);
    if (const auto found = worker->tokens.find(*token); found != worker->tokens.end()) {
      link = found->second.lock();
      worker->tokens.erase(found);
      if (link && link->answerer) link.reset();
      if (link) worker->bound[ep] = link;
    }
  }
  if (!link) {
    worker->refuse(ep, "an answer to no token of ours");
    return UCS_OK;
  }
  link->ready.store(true);
  UcxEvent event;
  event.kind = UcxEvent::Kind::kReady;
  link->emit(std::move(event));
  return UCS_OK;
}

ucs_status_t on_chunk(void* arg, const void* header, std::size_t header_length, void* data, std::size_t length,
                      const ucp_am_recv_param_t* param) {
  auto* worker = static_cast<UcxWorker::Impl*>(arg);
  const ucp_ep_h ep = reply_endpoint(param);
  bool retired = false;
  auto link = ep != nullptr ? worker->link_of(ep, retired) : nullptr;
  if (retired) return UCS_OK;  // sent before its connection closed
  if (!link) {
    worker->refuse(ep, "a chunk from an endpoint that presented no token");
    return UCS_OK;
  }
  if (header_length != kChunkHeaderBytes) {
    link->fail(fmt::format("a chunk message with a {}-byte header, not {}", header_length, kChunkHeaderBytes));
    return UCS_OK;
  }
  auto arrival = std::make_shared<UcxArrival>();
  std::memcpy(arrival->header.data(), header, kChunkHeaderBytes);
  arrival->length = length;
  ucs_status_t keep = UCS_OK;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    arrival->rendezvous = true;
    arrival->descriptor = data;
    keep = UCS_INPROGRESS;
  } else if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) != 0) {
    arrival->descriptor = data;
    keep = UCS_INPROGRESS;
  } else if (length > 0) {
    const auto* bytes = static_cast<const std::byte*>(data);
    arrival->copied.assign(bytes, bytes + length);
  }
  if (keep == UCS_INPROGRESS) arrival->worker = worker->shared_from_this();
  UcxEvent event;
  event.kind = UcxEvent::Kind::kArrival;
  event.arrival = arrival;
  if (!link->events.try_send(boost::system::error_code{}, std::move(event))) {
    // No room (more than a window ahead) or closed: UCX keeps its data; nothing of ours holds it.
    arrival->descriptor = nullptr;
    link->events.close();
    return UCS_OK;
  }
  return keep;
}

void on_endpoint_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  static_cast<UcxLink::Impl*>(arg)->fail(ucx_failure("endpoint", status).message);
}

}  // namespace

void UcxWorker::Impl::close_endpoint(ucp_ep_h ep) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  const ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) return;
  // Completed by later progress; the worker waits for it before it goes (a close still pending
  // at ucp_worker_destroy leaks the endpoint).
  const std::lock_guard lock(mutex);
  closing.push_back(request);
}

void UcxWorker::Impl::reap_closes(bool all) {
  std::vector<void*> pending;
  {
    const std::lock_guard lock(mutex);
    pending.swap(closing);
  }
  std::erase_if(pending, [all](void* request) {
    if (!all && ucp_request_check_status(request) == UCS_INPROGRESS) return false;
    ucp_request_free(request);
    return true;
  });
  if (pending.empty()) return;
  const std::lock_guard lock(mutex);
  closing.insert(closing.end(), pending.begin(), pending.end());
}

void UcxWorker::Impl::run_deferred() {
  std::vector<ucp_ep_h> refusing;
  std::vector<std::shared_ptr<UcxLink::Impl>> answering;
  {
    const std::lock_guard lock(mutex);
    refusing.swap(refused);
    answering.swap(answers);
  }
  for (const ucp_ep_h ep : refusing)
    close_endpoint(ep);
  reap_closes(false);
  for (const auto& link : answering) {
    ucp_ep_h ep = nullptr;
    {
      const std::lock_guard lock(link->mutex);
      ep = link->ep;
    }
    if (ep == nullptr) continue;  // closed meanwhile
    auto* op = new SendOp;
    std::memcpy(op->header.data(), link->token.data(), link->token.size());
    op->header_bytes = link->token.size();
    if (auto posted = post_am(*this, ep, kAmAuthOk, op, nullptr, 0); !posted) {
      spdlog::warn("UCX: answering a token: {}", posted.error().message);
    }
  }
}

UcxLink::Impl::~Impl() {
  if (ep != nullptr && !closed.load()) worker->close_endpoint(ep);
}

// ---- UcxArrival ----

UcxArrival::~UcxArrival() {
  if (descriptor != nullptr && worker) ucp_am_data_release(worker->worker, descriptor);
}

// ---- UcxContext ----

UcxContext::UcxContext(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxContext::~UcxContext() = default;

Result<std::shared_ptr<UcxContext>> UcxContext::create(const UcxPolicy& settings) {
  // Peer error handling on shared memory needs the mm transports' own error handling (set only
  // where they may be used: UCX warns of variables no transport read).
  const auto& tls = settings.tls;
  const bool shared_memory = tls.find("posix") != std::string::npos || tls.find("sm") != std::string::npos ||
                             tls.find("shm") != std::string::npos || tls.find("all") != std::string::npos;
  if (shared_memory) ::setenv("UCX_POSIX_ERROR_HANDLING", "y", 1);
  ucp_config_t* config = nullptr;
  if (const ucs_status_t read = ucp_config_read(nullptr, nullptr, &config); read != UCS_OK) {
    return outcome::failure(ucx_failure("read configuration", read));
  }
  const auto modify = [&](const char* name, const std::string& value) -> Status {
    if (const ucs_status_t status = ucp_config_modify(config, name, value.c_str()); status != UCS_OK) {
      return fail(ErrorCode::kInvalidArgument, fmt::format("UCX_{}={}: {}", name, value, ucs_status_string(status)));
    }
    return ok();
  };
  Status configured = modify("TLS", settings.tls);
  if (configured) configured = modify("NET_DEVICES", settings.net_devices);
  if (configured && settings.rndv_thresh_bytes > 0) {
    configured = modify("RNDV_THRESH", std::to_string(settings.rndv_thresh_bytes));
  }
  if (!configured) {
    ucp_config_release(config);
    return outcome::failure(configured.error());
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 1;
  params.name = "kvrelay";
  auto impl = std::make_unique<Impl>();
  const ucs_status_t status = ucp_init(&params, config, &impl->context);
  ucp_config_release(config);
  if (status != UCS_OK) {
    impl->context = nullptr;
    return fail(ErrorCode::kUnsupported, fmt::format("UCX context (UCX_TLS={}, UCX_NET_DEVICES={}): {}", settings.tls,
                                                     settings.net_devices, ucs_status_string(status)));
  }
  return std::shared_ptr<UcxContext>(new UcxContext(std::move(impl)));
}

Status UcxContext::register_memory(std::span<std::byte> memory) {
  if (memory.empty()) return ok();
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = memory.data();
  params.length = memory.size();
  ucp_mem_h memh = nullptr;
  if (const ucs_status_t status = ucp_mem_map(impl_->context, &params, &memh); status != UCS_OK) {
    return outcome::failure(ucx_failure(fmt::format("register {} bytes", memory.size()), status));
  }
  const std::lock_guard lock(impl_->mutex);
  impl_->regions.push_back({memory.data(), memory.size(), memh});
  return ok();
}

// ---- UcxWorker ----

namespace {

bool readable_now(int fd) {
  pollfd entry{fd, POLLIN, 0};
  return ::poll(&entry, 1, 0) > 0 && (entry.revents & POLLIN) != 0;
}

// Progress, arm, sleep on the event fd; repeat. Asio watches descriptors edge-triggered and does
// not remember an edge that came while no wait was pending, so an event landing between the arm
// and the wait would be lost: a check posted behind the wait (it runs once the wait is in place)
// looks at the fd once more and cuts the wait short if it is already readable.
asio::awaitable<void> progress_loop(std::shared_ptr<UcxWorker::Impl> self) {
  while (!self->stopping.load()) {
    self->progress();
    asio::post(self->executor, [self] {
      if (readable_now(self->wakeup->native_handle())) {
        boost::system::error_code ignored;
        self->wakeup->cancel(ignored);
      }
    });
    auto [ec] =
        co_await self->wakeup->async_wait(asio::posix::descriptor_base::wait_read, asio::as_tuple(asio::use_awaitable));
    if (ec && ec != asio::error::operation_aborted) {
      spdlog::warn("UCX worker event fd: {}", ec.message());
      break;
    }
  }
}

}  // namespace

UcxWorker::UcxWorker(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxWorker::~UcxWorker() {
  stop();
}

Result<std::shared_ptr<UcxWorker>> UcxWorker::create(std::shared_ptr<UcxContext> context,
                                                     asio::any_io_executor executor, UcxThreading threading,
                                                     std::function<void()> on_refused) {
  auto impl = std::make_shared<Impl>();
  impl->on_refused = std::move(on_refused);
  impl->context = std::move(context);
  impl->executor = executor;
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = threading == UcxThreading::kManyThreads ? UCS_THREAD_MODE_MULTI : UCS_THREAD_MODE_SERIALIZED;
  if (const ucs_status_t status = ucp_worker_create(impl->context->impl().context, &params, &impl->worker);
      status != UCS_OK) {
    impl->worker = nullptr;
    return outcome::failure(ucx_failure("worker", status));
  }
  int efd = -1;
  if (const ucs_status_t status = ucp_worker_get_efd(impl->worker, &efd); status != UCS_OK) {
    return outcome::failure(ucx_failure("worker event fd", status));
  }
  const int own = ::dup(efd);
  if (own < 0) return fail(ErrorCode::kResourceExhausted, "UCX worker event fd: dup failed");
  impl->wakeup = std::make_unique<asio::posix::stream_descriptor>(executor, own);
  ucp_worker_attr_t attributes{};
  attributes.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
  if (const ucs_status_t status = ucp_worker_query(impl->worker, &attributes); status != UCS_OK) {
    return outcome::failure(ucx_failure("worker address", status));
  }
  const auto* address = reinterpret_cast<const std::byte*>(attributes.address);
  impl->address.assign(address, address + attributes.address_length);
  ucp_worker_release_address(impl->worker, attributes.address);
  const std::array<std::pair<unsigned, ucp_am_recv_callback_t>, 3> handlers{
      {{kAmAuth, on_auth}, {kAmAuthOk, on_auth_ok}, {kAmChunk, on_chunk}}};
  for (const auto& [id, callback] : handlers) {
    ucp_am_handler_param_t handler{};
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                         UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    handler.id = id;
    handler.cb = callback;
    handler.arg = impl.get();
    handler.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
    if (const ucs_status_t status = ucp_worker_set_am_recv_handler(impl->worker, &handler); status != UCS_OK) {
      return outcome::failure(ucx_failure("active message handler", status));
    }
  }
  asio::co_spawn(executor, progress_loop(impl), asio::detached);
  return std::shared_ptr<UcxWorker>(new UcxWorker(std::move(impl)));
}

std::vector<std::byte> UcxWorker::address() const {
  return impl_->address;
}

namespace {

// An endpoint of ours to `remote_address` for `link`, with peer error handling: a failure of the
// peer is reported to the link (kFailed), and the endpoint stays ours to close.
Status dial_endpoint(UcxWorker::Impl& worker, UcxLink::Impl& link, std::span<const std::byte> remote_address) {
  if (remote_address.empty()) return fail(ErrorCode::kProtocol, "UCX: an empty worker address");
  ucp_ep_params_t params{};
  params.field_mask =
      UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(remote_address.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = on_endpoint_error;
  params.err_handler.arg = &link;
  ucp_ep_h ep = nullptr;
  if (const ucs_status_t status = ucp_ep_create(worker.worker, &params, &ep); status != UCS_OK) {
    return outcome::failure(ucx_failure("endpoint to the peer's worker", status));
  }
  const std::lock_guard lock(link.mutex);
  link.ep = ep;
  return ok();
}

}  // namespace

Result<std::shared_ptr<UcxLink>> UcxWorker::expect_link(std::span<const std::byte> remote_address) {
  UcxToken token{};
  if (RAND_bytes(reinterpret_cast<unsigned char*>(token.data()), static_cast<int>(token.size())) != 1) {
    return fail(ErrorCode::kInternal, "UCX: no random bytes for a connection token");
  }
  auto link = std::make_shared<UcxLink::Impl>(impl_, token, impl_->executor);
  link->answerer = true;
  auto result = std::make_shared<UcxLink>(link);
  if (auto dialled = dial_endpoint(*impl_, *link, remote_address); !dialled) return dialled.error();
  {
    const std::lock_guard lock(impl_->mutex);
    impl_->tokens[token] = link;
  }
  return result;
}

Result<std::shared_ptr<UcxLink>> UcxWorker::dial(std::span<const std::byte> remote_address, const UcxToken& token) {
  auto link = std::make_shared<UcxLink::Impl>(impl_, token, impl_->executor);
  auto result = std::make_shared<UcxLink>(link);
  if (auto dialled = dial_endpoint(*impl_, *link, remote_address); !dialled) return dialled.error();
  {
    const std::lock_guard lock(impl_->mutex);
    impl_->tokens[token] = link;
  }
  auto* op = new SendOp;
  std::memcpy(op->header.data(), token.data(), token.size());
  op->header_bytes = token.size();
  if (auto posted = post_am(*impl_, link->ep, kAmAuth, op, nullptr, 0); !posted) return posted.error();
  return result;
}

std::uint64_t UcxWorker::refused_endpoints() const noexcept {
  return impl_->refused_count.load();
}

void UcxWorker::stop() {
  if (!impl_ || impl_->stopping.exchange(true)) return;
  asio::post(impl_->executor, [self = impl_] {
    boost::system::error_code ignored;
    self->wakeup->cancel(ignored);
  });
}

// ---- UcxLink ----

UcxLink::UcxLink(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxLink::~UcxLink() {
  close();
}

const UcxToken& UcxLink::token() const noexcept {
  return impl_->token;
}

std::size_t UcxLink::sends_in_flight() const noexcept {
  return impl_->sends.load();
}

bool UcxLink::ready() const noexcept {
  return impl_->ready.load();
}

Status UcxLink::post_chunk(std::span<const std::byte, kChunkHeaderBytes> header, std::span<const std::byte> body) {
  if (impl_->closed.load() || impl_->failed.load()) return fail(ErrorCode::kIo, impl_->why_down());
  ucp_ep_h ep = nullptr;
  {
    const std::lock_guard lock(impl_->mutex);
    ep = impl_->ep;
  }
  if (ep == nullptr) return fail(ErrorCode::kProtocol, "UCX: no endpoint has presented this connection's token");
  auto* op = new SendOp;
  std::memcpy(op->header.data(), header.data(), kChunkHeaderBytes);
  op->header_bytes = kChunkHeaderBytes;
  op->link = impl_;
  return post_am(*impl_->worker, ep, kAmChunk, op, body.data(), body.size());
}

namespace {

struct ReceiveOp {
  std::shared_ptr<UcxLink::Impl> link;
};

void on_received(void* request, ucs_status_t status, std::size_t /*length*/, void* user_data) {
  auto* op = static_cast<ReceiveOp*>(user_data);
  if (status != UCS_OK) {
    op->link->fail(ucx_failure("receive", status).message);
  } else {
    UcxEvent event;
    event.kind = UcxEvent::Kind::kReceiveDone;
    op->link->emit(std::move(event));
  }
  delete op;
  ucp_request_free(request);
}

}  // namespace

Result<bool> UcxLink::receive(UcxArrival& arrival, std::span<std::uint8_t> into) {
  if (into.size() != arrival.length) {
    return fail(ErrorCode::kProtocol,
                fmt::format("UCX chunk of {} bytes where {} were expected", arrival.length, into.size()));
  }
  if (!arrival.rendezvous) {
    const void* source = arrival.descriptor != nullptr ? arrival.descriptor : arrival.copied.data();
    if (!into.empty()) std::memcpy(into.data(), source, into.size());
    if (arrival.descriptor != nullptr)
      ucp_am_data_release(impl_->worker->worker, std::exchange(arrival.descriptor, nullptr));
    return true;
  }
  auto* op = new ReceiveOp{impl_};
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.recv_am = on_received;
  param.user_data = op;
  if (ucp_mem_h memh = impl_->worker->context->impl().registered(into.data(), into.size()); memh != nullptr) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    param.memh = memh;
  }
  const ucs_status_ptr_t request = ucp_am_recv_data_nbx(
      impl_->worker->worker, std::exchange(arrival.descriptor, nullptr), into.data(), into.size(), &param);
  if (request == nullptr) {
    delete op;
    return true;
  }
  if (UCS_PTR_IS_ERR(request)) {
    delete op;
    return outcome::failure(ucx_failure("receive", UCS_PTR_STATUS(request)));
  }
  impl_->worker->kick();
  return false;
}

asio::awaitable<Result<UcxEvent>> UcxLink::next_event() {
  auto [ec, event] = co_await impl_->events.async_receive(asio::as_tuple(asio::use_awaitable));
  if (ec) co_return fail(ErrorCode::kIo, impl_->why_down());
  co_return std::move(event);
}

std::vector<std::string> UcxLink::lanes() const {
  ucp_ep_h ep = nullptr;
  {
    const std::lock_guard lock(impl_->mutex);
    ep = impl_->ep;
  }
  std::vector<std::string> lanes;
  if (ep == nullptr || impl_->closed.load()) return lanes;
  char* text = nullptr;
  std::size_t size = 0;
  FILE* stream = open_memstream(&text, &size);
  if (stream == nullptr) return lanes;
  ucp_ep_print_info(ep, stream);
  std::fclose(stream);
  std::istringstream lines(std::string(text, size));
  std::free(text);
  // "lane[0]:  1:tcp/lo.0 md[0]  -> md[0]/tcp/sysdev[255] am": transport/device and its uses.
  for (std::string line; std::getline(lines, line);) {
    const auto at = line.find("lane[");
    if (at == std::string::npos) continue;
    std::istringstream words(line.substr(at));
    std::string word;
    std::string device;
    std::string uses;
    words >> word >> device;  // "lane[0]:", "1:tcp/lo.0"
    device = device.substr(device.find(':') + 1);
    while (words >> word && word != "->") {
    }
    words >> word;  // the remote side's md and transport
    while (words >> word)
      uses += (uses.empty() ? "" : " ") + word;
    lanes.push_back(uses.empty() ? device : device + ": " + uses);
  }
  return lanes;
}

void UcxLink::close() {
  if (!impl_ || impl_->closed.exchange(true)) return;
  auto& worker = *impl_->worker;
  ucp_ep_h ep = nullptr;
  {
    const std::lock_guard lock(impl_->mutex);
    ep = std::exchange(impl_->ep, nullptr);
  }
  {
    const std::lock_guard lock(worker.mutex);
    worker.tokens.erase(impl_->token);
  }
  if (ep != nullptr) worker.close_endpoint(ep);
  impl_->events.close();
  // Arrivals not taken hold UCX's receive buffers (on shared memory, its fifo's): give them back
  // now, not when the last reference to this link goes.
  while (impl_->events.try_receive([](boost::system::error_code, UcxEvent) {})) {
  }
  worker.kick();
}

#else  // no UCX in this build: every entry point says so

struct UcxContext::Impl {};
struct UcxWorker::Impl {};
struct UcxLink::Impl {};

namespace {
Error not_built() {
  return Error{ErrorCode::kUnsupported, "this kvrelay was built without UCX (libucx-dev): no ucx transport"};
}
}  // namespace

UcxArrival::~UcxArrival() = default;
UcxContext::UcxContext(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxContext::~UcxContext() = default;
Result<std::shared_ptr<UcxContext>> UcxContext::create(const UcxPolicy&) {
  return not_built();
}
Status UcxContext::register_memory(std::span<std::byte>) {
  return not_built();
}
UcxWorker::UcxWorker(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxWorker::~UcxWorker() = default;
Result<std::shared_ptr<UcxWorker>> UcxWorker::create(std::shared_ptr<UcxContext>, asio::any_io_executor, UcxThreading,
                                                     std::function<void()>) {
  return not_built();
}
std::vector<std::byte> UcxWorker::address() const {
  return {};
}
Result<std::shared_ptr<UcxLink>> UcxWorker::expect_link(std::span<const std::byte>) {
  return not_built();
}
Result<std::shared_ptr<UcxLink>> UcxWorker::dial(std::span<const std::byte>, const UcxToken&) {
  return not_built();
}
std::uint64_t UcxWorker::refused_endpoints() const noexcept {
  return 0;
}
void UcxWorker::stop() {}
UcxLink::UcxLink(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxLink::~UcxLink() = default;
const UcxToken& UcxLink::token() const noexcept {
  static const UcxToken none{};
  return none;
}
std::size_t UcxLink::sends_in_flight() const noexcept {
  return 0;
}
bool UcxLink::ready() const noexcept {
  return false;
}
Status UcxLink::post_chunk(std::span<const std::byte, kChunkHeaderBytes>, std::span<const std::byte>) {
  return not_built();
}
Result<bool> UcxLink::receive(UcxArrival&, std::span<std::uint8_t>) {
  return not_built();
}
asio::awaitable<Result<UcxEvent>> UcxLink::next_event() {
  co_return not_built();
}
std::vector<std::string> UcxLink::lanes() const {
  return {};
}
void UcxLink::close() {}

#endif

}  // namespace kvrelay::peer
