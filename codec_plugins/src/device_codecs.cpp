#include "kvrelay/codec_plugins/device_codecs.h"

#include <fmt/format.h>

#include "kvrelay/codec_plugins/builtin_codecs.h"

#if defined(KVRELAY_HAVE_CUDA)
#include "cuda_staged.h"
#endif

namespace kvrelay::codec {

Result<const kvrelay_codec_plugin*> cuda_implementation(std::uint32_t codec_id) {
  if (codec_id != kFp8CodecId && codec_id != kInt8CodecId && codec_id != kInt4CodecId) {
    return fail(ErrorCode::kUnsupported,
                fmt::format("codec id {} has no CUDA implementation (fp8, int8 and int4 have)", codec_id));
  }
#if defined(KVRELAY_HAVE_CUDA)
  return detail::staged_cuda_codec(codec_id);
#else
  return fail(ErrorCode::kUnsupported, "this kvrelay was built without CUDA (nvcc was not found)");
#endif
}

}  // namespace kvrelay::codec
