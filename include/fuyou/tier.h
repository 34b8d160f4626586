// Where bytes live: device memory, host memory, or the SSD store. One type for the planner's
// buffers, a layer's weights, gradients and optimizer state, and the out-of-core optimizer's
// groups (which keep state in host memory or on SSD only).
#pragma once

namespace fuyou {

enum class Tier { kDevice, kHost, kSsd };

// "device", "host", "ssd": as plans print them and the simulator's JSON writes them.
inline const char* tier_name(Tier t) {
  switch (t) {
    case Tier::kDevice:
      return "device";
    case Tier::kHost:
      return "host";
    case Tier::kSsd:
      return "ssd";
  }
  return "?";
}

}  // namespace fuyou
