// The checks a training run makes before it changes anything on disk, as one function that
// the run and `fuyou-train --dry-run` both call, so that a dry run refuses exactly what the run
// would refuse, with the same exception and the same words: the run directory's state and
// permissions, its free space, the SSD store's directories (existing, distinct, writable with
// O_DIRECT), the data and model files (readable), the shards against the run's tokenizer, and
// checkpoints/best with keep_best.
#pragma once

#include <filesystem>
#include <string>

#include "fuyou/config.h"
#include "fuyou/train.h"

namespace fuyou {

// The path itself when it exists, else its nearest existing ancestor (absolute): where a
// directory the run creates will be, for its filesystem's free space and identity.
std::filesystem::path existing_ancestor(const std::filesystem::path& path);

// The run directory a run with these options uses: opts.run_dir; else, resuming, the
// checkpoint's run; else runs/<UTC date-time>.
std::string resolved_run_dir(const TrainOptions& opts);

// Throws what the run would throw (Error, ConfigError or IoError naming the path, the key and
// the numbers) for the run of `cfg` with `opts` in `run_dir`; changes nothing (a probe file is
// created and removed where writability is checked).
void check_before_run(const Config& cfg, const TrainOptions& opts, const std::string& run_dir);

// The run directory must hold the final weights and the checkpoints the run keeps (plus the
// one being written before the oldest goes), beyond those already there; a graceful stop
// writes one even with checkpoints off. IoError with the figures when it does not.
void check_run_dir_space(const Config& cfg, const std::string& run_dir);

bool checkpoints_on(const CheckpointConfig& c);

// Where the base model's files (config.json, the tokenizer) come from for a run in another
// directory: the resumed checkpoint's run when it branches from it, else model.checkpoint's
// directory; "" when none (a new run from scratch, or a run continuing in its own directory).
std::string carry_source(const Config& cfg, const TrainOptions& opts, bool same_run);

// The tokenizer.json a training run's shards must have been tokenized with: the run
// directory's, else carry_source's; "" when there is none.
std::string run_tokenizer_path(const Config& cfg, const TrainOptions& opts,
                               const std::string& run_dir, bool same_run);

// A shard of header vocabulary `shard_vocab` against the run's tokenizer (`tokenizer`, of
// `tokenizer_vocab` tokens) or, without one, model.vocab_size: ConfigError naming the shard,
// both sizes and the tokenizer to tokenize with.
void check_shard_vocab(const std::string& shard, uint32_t shard_vocab, int model_vocab,
                       const std::string& tokenizer, uint32_t tokenizer_vocab);

}  // namespace fuyou
