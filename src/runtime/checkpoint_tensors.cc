#include "src/runtime/checkpoint_tensors.h"

#include <algorithm>
#include <cstring>

#include "fuyou/error.h"

namespace fuyou {

StateSink GroupTensorWriter::group_sink(int g) {
  FY_CHECK(group_ < 0, "group ", group_, " still open");
  group_ = g;
  XXH3_64bits_reset(hash_.get());
  const ParamGroup& pg = layout_.groups.at(g);
  return [this, &pg](size_t begin, const float* data, size_t n) {
    const size_t end = begin + n;
    for (size_t i = pg.first_tensor; i < pg.first_tensor + pg.num_tensors; ++i) {
      const TensorSpec& t = layout_.tensors[i];
      const size_t t0 = t.offset - pg.offset, t1 = t0 + t.numel;
      const size_t lo = std::max(begin, t0), hi = std::min(end, t1);
      if (lo >= hi) continue;
      if (lo == t0) w_.begin_tensor(prefix_ + t.name);
      const float* p = data + (lo - begin);
      w_.append(p, 4 * (hi - lo));
      xxh3_64_update(hash_.get(), p, 4 * (hi - lo));
    }
  };
}

std::string GroupTensorWriter::finish_group() {
  group_ = -1;
  return hex64(XXH3_64bits_digest(hash_.get()));
}

GroupTensorReader::GroupTensorReader(const RangedTensorFile& f, const ParamLayout& layout,
                                     std::string prefix)
    : f_(f), layout_(layout), prefix_(std::move(prefix)) {
  for (const TensorSpec& t : layout_.tensors) {
    const std::string name = prefix_ + t.name;
    if (!f_.reader().has(name))
      throw IoError(
          str(f_.path(), ": no tensor '", name, "' (the checkpoint does not match this model)"));
    const StTensorInfo& info = f_.reader().info(name);
    if (info.dtype != StDtype::kF32 || info.shape != t.shape)
      throw IoError(str(f_.path(), ": tensor '", name, "' is not F32 of the model's shape"));
  }
}

StateSource GroupTensorReader::group_source(int g) {
  FY_CHECK(group_ < 0, "group ", group_, " still open");
  group_ = g;
  next_ = 0;
  XXH3_64bits_reset(hash_.get());
  const ParamGroup& pg = layout_.groups.at(g);
  return [this, &pg](size_t begin, float* data, size_t n) {
    FY_CHECK(begin == next_, "group ", pg.name, ": piece at ", begin, ", expected ", next_);
    next_ = begin + n;
    std::fill(data, data + n, 0.0f);  // padding between tensors
    const size_t end = begin + n;
    for (size_t i = pg.first_tensor; i < pg.first_tensor + pg.num_tensors; ++i) {
      const TensorSpec& t = layout_.tensors[i];
      const size_t t0 = t.offset - pg.offset, t1 = t0 + t.numel;
      const size_t lo = std::max(begin, t0), hi = std::min(end, t1);
      if (lo >= hi) continue;
      float* p = data + (lo - begin);
      f_.read(f_.reader().info(prefix_ + t.name), 4 * (lo - t0), p, 4 * (hi - lo));
      xxh3_64_update(hash_.get(), p, 4 * (hi - lo));
    }
  };
}

std::string GroupTensorReader::finish_group() {
  group_ = -1;
  return hex64(XXH3_64bits_digest(hash_.get()));
}

}  // namespace fuyou
