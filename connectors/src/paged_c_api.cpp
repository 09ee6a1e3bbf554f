// kvrelay_paged.h over gather_paged/scatter_paged. Compiled into libkvrelay_client.so (whose
// c_api.cpp shares this file's unity translation unit, hence the distinct names). No exception
// or C++ type crosses this boundary.

#include <cstring>
#include <exception>
#include <span>
#include <string>

#include "kvrelay/connectors/kvrelay_paged.h"
#include "kvrelay/connectors/paged_copy.h"
#include "kvrelay/core/error.h"

static_assert(KVRELAY_E_INVALID_ARGUMENT == static_cast<int>(kvrelay::ErrorCode::kInvalidArgument));
static_assert(KVRELAY_E_OVERFLOW == static_cast<int>(kvrelay::ErrorCode::kOverflow));
static_assert(KVRELAY_E_OUT_OF_RANGE == static_cast<int>(kvrelay::ErrorCode::kOutOfRange));
static_assert(KVRELAY_E_INTERNAL == static_cast<int>(kvrelay::ErrorCode::kInternal));
static_assert(KVRELAY_PAGED_FLASH_ATTN == static_cast<int>(kvrelay::connectors::PagedLayout::kFlashAttn));
static_assert(KVRELAY_PAGED_FLASHINFER == static_cast<int>(kvrelay::connectors::PagedLayout::kFlashInfer));
static_assert(KVRELAY_PAGED_CPU == static_cast<int>(kvrelay::connectors::PagedLayout::kCpu));

namespace paged_c_api_detail {

thread_local std::string paged_last_error_message;

int paged_record(const kvrelay::Error& error) noexcept {
  try {
    paged_last_error_message = error.to_string();
  } catch (...) {
    paged_last_error_message.clear();
  }
  // c_api.cpp checks that every ErrorCode crosses the C ABI as its own number.
  return static_cast<int>(error.code);
}

kvrelay::Result<kvrelay::connectors::PagedTensorView> paged_view(const kvrelay_paged_tensor* cache) {
  using kvrelay::ErrorCode;
  if (cache == nullptr) return kvrelay::fail(ErrorCode::kInvalidArgument, "kvrelay_paged_tensor is null");
  if (cache->struct_size != sizeof(kvrelay_paged_tensor)) {
    return kvrelay::fail(ErrorCode::kInvalidArgument, "kvrelay_paged_tensor.struct_size " +
                                                          std::to_string(cache->struct_size) + " is not " +
                                                          std::to_string(sizeof(kvrelay_paged_tensor)));
  }
  if (cache->reserved != 0) {
    return kvrelay::fail(ErrorCode::kInvalidArgument, "kvrelay_paged_tensor.reserved is not 0");
  }
  if (cache->layout < KVRELAY_PAGED_FLASH_ATTN || cache->layout > KVRELAY_PAGED_CPU) {
    return kvrelay::fail(ErrorCode::kInvalidArgument,
                         "kvrelay_paged_tensor.layout " + std::to_string(cache->layout) + " is unknown");
  }
  kvrelay::connectors::PagedTensorView view;
  view.layout = static_cast<kvrelay::connectors::PagedLayout>(cache->layout);
  view.elem_size = cache->elem_size;
  view.data = cache->data;
  for (std::size_t axis = 0; axis < 5; ++axis) {
    view.shape[axis] = cache->shape[axis];
    view.strides[axis] = cache->strides[axis];
  }
  return view;
}

template <class Copy>
int paged_call(const kvrelay_paged_tensor* cache, const int32_t* block_ids, uint64_t num_block_ids,
               uint64_t first_token, uint64_t tokens, Copy&& copy) noexcept {
  try {
    if (block_ids == nullptr && num_block_ids != 0) {
      return paged_record(kvrelay::Error{kvrelay::ErrorCode::kInvalidArgument, "block_ids is null"});
    }
    auto view = paged_view(cache);
    if (!view) return paged_record(view.error());
    const kvrelay::connectors::PagedSpan span{
        block_ids == nullptr ? std::span<const std::int32_t>{}
                             : std::span<const std::int32_t>{block_ids, static_cast<std::size_t>(num_block_ids)},
        first_token, tokens};
    const kvrelay::Status status = copy(view.value(), span);
    if (!status) return paged_record(status.error());
    paged_last_error_message.clear();
    return KVRELAY_OK;
  } catch (const std::exception& error) {
    return paged_record(kvrelay::Error{kvrelay::ErrorCode::kInternal, error.what()});
  } catch (...) {
    return paged_record(kvrelay::Error{kvrelay::ErrorCode::kInternal, "unknown exception"});
  }
}

}  // namespace paged_c_api_detail

extern "C" {

int kvrelay_paged_gather(const kvrelay_paged_tensor* cache, const int32_t* block_ids, uint64_t num_block_ids,
                         uint64_t first_token, uint64_t tokens, void* k_dst, void* v_dst) {
  return paged_c_api_detail::paged_call(
      cache, block_ids, num_block_ids, first_token, tokens,
      [&](const kvrelay::connectors::PagedTensorView& view, const kvrelay::connectors::PagedSpan& span) {
        return kvrelay::connectors::gather_paged(view, span, k_dst, v_dst);
      });
}

int kvrelay_paged_scatter(const kvrelay_paged_tensor* cache, const int32_t* block_ids, uint64_t num_block_ids,
                          uint64_t first_token, uint64_t tokens, const void* k_src, const void* v_src) {
  return paged_c_api_detail::paged_call(
      cache, block_ids, num_block_ids, first_token, tokens,
      [&](const kvrelay::connectors::PagedTensorView& view, const kvrelay::connectors::PagedSpan& span) {
        return kvrelay::connectors::scatter_paged(view, span, k_src, v_src);
      });
}

const char* kvrelay_paged_last_error(void) {
  return paged_c_api_detail::paged_last_error_message.c_str();
}

int kvrelay_paged_abi_version(void) {
  return KVRELAY_PAGED_ABI_VERSION;
}

}  // extern "C"
