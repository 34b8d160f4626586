// Training FLOP accounting lives with the model (forward_flops_per_token); this file keeps
// the runtime-side helpers that turn it into rates.
#include "fuyou/model.h"

namespace fuyou {

double training_tflops(const ModelConfig& cfg, double tokens_per_s) {
  return 3.0 * forward_flops_per_token(cfg) * tokens_per_s / 1e12;
}

}  // namespace fuyou
