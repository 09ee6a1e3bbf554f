#include "kvrelay/refworker/model_source.h"

namespace kvrelay::refworker {

Result<Model> load_model(const ModelSource& source) {
  if (source.checkpoint_path.empty() == source.synthetic_shape.empty()) {
    return fail(ErrorCode::kInvalidArgument, "give exactly one of a checkpoint path or a synthetic shape");
  }
  if (!source.checkpoint_path.empty()) return load_llama2c(source.checkpoint_path);
  KVRELAY_TRY(const ModelConfig config, parse_shape(source.synthetic_shape));
  return make_synthetic(config, source.seed);
}

}  // namespace kvrelay::refworker
