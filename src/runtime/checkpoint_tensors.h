// The tensor side of a checkpoint: one parameter group's state in pieces (the engine's
// StateSink / StateSource) mapped onto the engine's tensors in a safetensors file, with the
// group's XXH3-64 computed over the tensor bytes in file order on both sides.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "fuyou/model.h"
#include "fuyou/train_state.h"
#include "src/common/xxh3.h"
#include "src/formats/safetensors_stream.h"

namespace fuyou {

// Appends groups to an open writer whose entries are `prefix + name` for every tensor of
// the layout, in layout order.
class GroupTensorWriter {
 public:
  GroupTensorWriter(SafetensorsStreamWriter& w, const ParamLayout& layout, std::string prefix)
      : w_(w), layout_(layout), prefix_(std::move(prefix)) {}
  // The sink for group g; call finish_group() after the engine has streamed all of it.
  StateSink group_sink(int g);
  std::string finish_group();  // the group's checksum (hex)

 private:
  SafetensorsStreamWriter& w_;
  const ParamLayout& layout_;
  std::string prefix_;
  int group_ = -1;
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> hash_{XXH3_createState(),
                                                                 &XXH3_freeState};
};

// Fills pieces of group g from a validated file holding `prefix + name` tensors (fp32, the
// layout's shapes); padding between tensors is zero.
class GroupTensorReader {
 public:
  GroupTensorReader(const RangedTensorFile& f, const ParamLayout& layout, std::string prefix);
  StateSource group_source(int g);
  std::string finish_group();

 private:
  const RangedTensorFile& f_;
  const ParamLayout& layout_;
  std::string prefix_;
  int group_ = -1;
  size_t next_ = 0;  // the group-relative element the next piece must start at
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> hash_{XXH3_createState(),
                                                                 &XXH3_freeState};
};

}  // namespace fuyou
