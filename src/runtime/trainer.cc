#include <algorithm>
#include <cmath>
#include <cstddef>
#include <utility>
#include <vector>

#include "fuyou/error.h"
#include "fuyou/optim.h"
#include "fuyou/train.h"
#include "kernels/common/element_math.h"
#include "kernels/common/grad_math.h"

namespace fuyou {

double group_sum_squares(const void* g, ElemType type, size_t n) {
  return math::group_sum_squares(g, type, n);
}

void add_to_fp32_sum(float* sum, const void* g, ElemType type, size_t n, bool first) {
  math::accumulate_fp32(sum, g, type, n, first);
}

void split_batch(const int32_t* batch, int B, int T, int32_t* inputs, int32_t* targets) {
  for (int b = 0; b < B; ++b) {
    const int32_t* row = batch + static_cast<size_t>(b) * (T + 1);
    std::copy(row, row + T, inputs + static_cast<size_t>(b) * T);
    std::copy(row + 1, row + T + 1, targets + static_cast<size_t>(b) * T);
  }
}

int64_t split_batch(const int32_t* batch, const uint8_t* counted, int B, int T, int32_t* inputs,
                    int32_t* targets) {
  split_batch(batch, B, T, inputs, targets);
  if (!counted) return static_cast<int64_t>(B) * T;
  int64_t n = 0;
  for (size_t i = 0; i < static_cast<size_t>(B) * T; ++i) {
    if (counted[i])
      ++n;
    else
      targets[i] = kIgnoreTarget;
  }
  return n;
}

int64_t count_targets(const uint8_t* counted, int B, int T) {
  const size_t n = static_cast<size_t>(B) * T;
  if (!counted) return static_cast<int64_t>(n);
  return std::count_if(counted, counted + n, [](uint8_t c) { return c != 0; });
}

double mean_over_counted(const std::vector<float>& means, const std::vector<int64_t>& counts) {
  FY_CHECK(means.size() == counts.size() && !means.empty(), "mean_over_counted: ", means.size(),
           " means for ", counts.size(), " counts");
  if (std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; })) {
    double s = 0;
    for (float m : means) s += m;
    return s / static_cast<double>(means.size());
  }
  double s = 0, total = 0;
  for (size_t i = 0; i < means.size(); ++i) {
    s += static_cast<double>(means[i]) * static_cast<double>(counts[i]);
    total += static_cast<double>(counts[i]);
  }
  return total > 0 ? s / total : 0.0;
}

std::vector<OptimGroup> optimizer_groups(const ParamLayout& layout) {
  std::vector<OptimGroup> groups;
  for (const ParamGroup& pg : layout.groups) {
    OptimGroup og{pg.name, pg.numel, {}};
    for (size_t i = pg.first_tensor; i < pg.first_tensor + pg.num_tensors; ++i) {
      const TensorSpec& t = layout.tensors[i];
      og.tensors.push_back({t.offset - pg.offset, t.numel, t.decay});
    }
    groups.push_back(og);
  }
  return groups;
}

OptimFormat optim_format(const OptimizerConfig& o) {
  OptimFormat f;
  f.moments = o.state == "int8"   ? MomentFormat::kInt8
              : o.state == "bf16" ? MomentFormat::kBF16
                                  : MomentFormat::kF32;
  f.master = o.master == "split" ? MasterFormat::kSplit : MasterFormat::kF32;
  return f;
}

void check_optim_format(const OptimizerConfig& o, ElemType tensors) {
  if (optim_format(o).master == MasterFormat::kSplit && tensors != ElemType::kBF16)
    throw ConfigError(str(
        "optimizer.master is split: the master is kept as the bf16 working weight plus a 16-bit ",
        "remainder, which needs runtime.device_tensors: bf16 (this run's tensors are ",
        elem_type_name(tensors), "); use optimizer.master: fp32"));
}

OocAdamWOptions optimizer_options(const OptimizerConfig& o) {
  OocAdamWOptions oo;
  oo.format = optim_format(o);
  oo.beta1 = static_cast<float>(o.beta1);
  oo.beta2 = static_cast<float>(o.beta2);
  oo.eps = static_cast<float>(o.eps);
  oo.weight_decay = static_cast<float>(o.weight_decay);
  return oo;
}

}  // namespace fuyou
