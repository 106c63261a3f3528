// Exit statuses a spindle process and its launcher agree on beyond 0 (success) and the usual
// failures (1, 2, 128 + signal).
#pragma once

namespace spindle {

// A training run that stopped on a signal after saving a checkpoint: `--resume` continues it. 75 is
// EX_TEMPFAIL of <sysexits.h>, "a temporary failure: try again later". The launcher returns it when
// every rank stopped this way.
inline constexpr int kExitStoppedResumable = 75;

}  // namespace spindle
