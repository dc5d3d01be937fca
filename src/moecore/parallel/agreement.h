// Text over a process group, and failures that every rank learns of: a step that can fail on some ranks only (a
// file a rank cannot read, a write that fails) must not leave the others waiting in the next collective.
#pragma once

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/parallel/process_group.h"

namespace moecore::parallel {

// Every rank's `text`, indexed by group rank (collective).
std::vector<std::string> all_gather_text(const ProcessGroup& group, const std::string& text);
// Rank `root`'s `text` on every rank (collective).
std::string broadcast_text(const ProcessGroup& group, const std::string& text, int root);

// Thrown on every rank when `run_on_all_ranks` saw a failure on any rank.
class GroupFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Runs `step` on this rank, then agrees (collective): when any rank's step threw a std::exception, every rank throws
// GroupFailure with the message of the lowest failing rank. A step must not itself call collectives that other ranks
// skip when it fails.
void run_on_all_ranks(const ProcessGroup& group, const std::function<void()>& step);

}  // namespace moecore::parallel
