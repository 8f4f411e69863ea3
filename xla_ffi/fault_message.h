// The text of a device-side fault record (cuda/device_state.h: FaultRecord), the one place that
// writes it: runtime.faults() / check_errors() show it, the CPU tests check it for given records
// (_C.fault_message) and the kernel emulator prints it. Plain C++ (no CUDA), so the emulator's g++
// build compiles it too.
#pragma once

#include <cstdint>
#include <string>

#include "cuda/device_state.h"

namespace jax_ep {

// Names of the enums of a record ("unknown" / "" outside them).
const char* FaultKindName(int32_t kind);         // "timeout", "mismatch", ...
const char* OpName(int32_t op_id);               // "dispatch", "ll_combine", ...
const char* FingerprintFieldName(int32_t field); // "hidden", "call_sequence", ... ("" for none)

// The message of a record (its fields copied out of the pinned memory). per_process: process
// model 2, where a peer's slot is its process index (named "process N", else "GPU N").
std::string FaultMessage(const FaultRecord& record, bool per_process);

}  // namespace jax_ep
