// The directory transaction of a save. A checkpoint root holds
//   step-<N>/         committed checkpoints (manifest.json and the ranks' shard files)
//   latest            "step-<N>\n": the newest committed one
//   tmp-<N>-<pid>/    a save in progress (or one whose process died)
//   old-<N>-<pid>/    a step-<N> being replaced by a new save of the same step
//
// Atomicity: the files are written under tmp-<N>-<pid> and fsync'd, the directory is fsync'd and
// renamed to step-<N>, the root is fsync'd, and `latest` is replaced by writing latest.tmp-<pid>,
// fsyncing it and renaming it over `latest` (then the root is fsync'd again). A crash at any
// point leaves `latest` naming a complete checkpoint (the previous one until the last rename),
// plus perhaps a temporary directory that the next save removes once its process is gone.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zinf/core/status.h"

namespace zinf::ckpt {

std::string step_dir_name(int64_t step);  // "step-<N>"

// Creates `root` (and its parents) when missing, and the empty temporary directory
// `root/tmp-<step>-<pid>` (0700); an existing one is an error.
Result<std::string> create_temp_dir(const std::string& root, int64_t step, uint64_t pid);

// fsync of a directory (its entries made durable).
Status fsync_dir(const std::string& path);

// Makes the temporary directory `tmp` the checkpoint `root/step-<step>` and points `latest` at
// it. An existing step-<step> (a save of the same step again) is replaced only once the new one
// is complete. Returns the committed directory.
Result<std::string> commit_dir(const std::string& root, const std::string& tmp, int64_t step);

// Keeps the newest `keep` committed checkpoints (by step; 0 = keep all) and the one `latest`
// names; removes the older ones, and temporary directories whose process has gone.
Status prune(const std::string& root, int keep);

// A checkpoint directory from what a user names: a directory holding manifest.json, or a root
// whose `latest` names one (or, when a save of that same step died while replacing it, the
// previous one still moved aside as old-<N>-<pid>). kNotFound says which was looked for.
Result<std::string> resolve_checkpoint(const std::string& path);

// The committed checkpoints under `root`, oldest first.
std::vector<int64_t> list_steps(const std::string& root);

// Removes a directory tree (ENOENT is success).
Status remove_tree(const std::string& path);

}  // namespace zinf::ckpt
