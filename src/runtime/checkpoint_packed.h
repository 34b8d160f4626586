// Checkpoints of packed Adam moments (optimizer.state bf16 / int8): each parameter group's
// moment as stored, in optimizer.safetensors entries per group, so that a resume in the same
// format continues bit for bit; and the conversions between formats when the run's format
// differs from the checkpoint's (docs/checkpoints.md, "Optimizer state formats").
//
// Entries, per kind (adam_m, then adam_v) and group in layout order: "adam_m.GROUP" (BF16, or
// U8 int8 codes: m's two's complement, v's unsigned; the group's elements, padding included)
// and for int8 "adam_m.GROUP.scale" (F32, one per block of 256 elements). A group's checksum
// (CheckpointManifest::group_xxh3) covers its entries' bytes in file order.
#pragma once

#include <string>
#include <vector>

#include "fuyou/engine.h"
#include "fuyou/model.h"
#include "src/formats/safetensors_stream.h"

namespace fuyou {

std::vector<StEntry> packed_moment_entries(const ParamLayout& layout, MomentFormat f,
                                           StateKind kind);

// Streams `kind` of every group from the engine (as stored) into `w`; the groups' checksums.
std::vector<std::string> write_packed_moments(TrainEngine& engine, const ParamLayout& layout,
                                              SafetensorsStreamWriter& w, StateKind kind);

// Sets group g's `kind` from a file written in format `file` (checked by its entries): as
// stored when the engine's moments are in the same format, else decoded to fp32 and given to
// the engine's write_state (which encodes for its own format). Returns the group's checksum.
std::string restore_packed_moment(TrainEngine& engine, const RangedTensorFile& f,
                                  const ParamLayout& layout, int g, StateKind kind,
                                  MomentFormat file);

}  // namespace fuyou
