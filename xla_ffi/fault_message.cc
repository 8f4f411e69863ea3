#include "xla_ffi/fault_message.h"

#include <string>

#include "cuda/ep_layout.h"
#include "cuda/fingerprint.h"

namespace jax_ep {
namespace {

std::string Str(uint64_t value) { return std::to_string(value); }

// A fingerprint field's value as the user knows it: op, dtype and transport by name (the
// transport as KernelConfig.transport spells it).
std::string FieldValue(int32_t field, uint64_t value) {
  if (field == kFieldOp) return OpName(static_cast<int32_t>(value));
  if (field == kFieldTransport) {
    return value == kTransportLoadStore ? "load_store"
           : value == kTransportPut     ? "put"
           : value == kTransportPull    ? "pull"
                                        : "transport " + Str(value);
  }
  if (field == kFieldDtype) {
    switch (value) {
      case kRowBF16:
        return "bfloat16";
      case kRowF32:
        return "float32";
      case kRowFP8:
        return "float8_e4m3fn";
      default:
        return "dtype " + Str(value);
    }
  }
  return Str(value);
}

// The message of a kFaultLLInFlight record (cuda/device_state.h, LLFault).
std::string LLInFlightMessage(const std::string& where, int what, uint64_t expected,
                              uint64_t observed) {
  switch (what) {
    case kLLFaultTooMany:
      return where + "call " + Str(expected) + " would overwrite the receive buffer of call " +
             Str(observed) + ", sent in two phases and not received yet: receive call n of an op "
             "before its call n + 2, fused or sent (every call of the op counts).";
    case kLLFaultShape:
      return where + "a low-latency call of another shape ran while two-phase low-latency calls "
             "were in flight (sent, not received), or a receive got the pending value of a send of "
             "another shape (its EPConfig must be the send's).";
    case kLLFaultStaleToken:
      return where + "the receive of call " + Str(expected) + " found it not in flight (the "
             "receive buffer holds call " + Str(observed) + "): the pending value of each _send must "
             "be received exactly once, before the call after next is sent.";
    default:
      return where + "a throughput EP op ran while " + Str(observed) + " two-phase low-latency "
             "calls were in flight (sent, not received): receive them first.";
  }
}

}  // namespace

const char* FaultKindName(int32_t kind) {
  switch (kind) {
    case kFaultTimeout:
      return "timeout";
    case kFaultStaleRuntime:
      return "stale_runtime";
    case kFaultBadArgument:
      return "bad_argument";
    case kFaultLLInFlight:
      return "ll_in_flight";
    case kFaultMismatch:
      return "mismatch";
    default:
      return "unknown";
  }
}

const char* OpName(int32_t op_id) {
  switch (op_id) {
#define JAX_EP_OP_NAME(Name, name, id) \
  case kOp##Name:                      \
    return #name;
    JAX_EP_FAULT_OPS(JAX_EP_OP_NAME)
#undef JAX_EP_OP_NAME
    default:
      return "unknown";
  }
}

const char* FingerprintFieldName(int32_t field) {
  switch (field) {
    case kFieldOp:
      return "op";
    case kFieldRanks:
      return "num_ranks";
    case kFieldTokens:
      return "num_tokens";
    case kFieldHidden:
      return "hidden";
    case kFieldTopk:
      return "num_topk";
    case kFieldExperts:
      return "num_experts";
    case kFieldCapacity:
      return "capacity";
    case kFieldAlignment:
      return "expert_alignment";
    case kFieldDtype:
      return "dtype";
    case kFieldTransport:
      return "transport";
    case kFieldSequence:
      return "call_sequence";
    case kFieldPrepBlocks:
      return "prep_blocks";
    case kFieldFingerprintWords:
      return "fingerprint_words";
    case kFieldForeignFlag:
      return "foreign_flag";
    default:
      return "";
  }
}

std::string FaultMessage(const FaultRecord& r, bool per_process) {
  const std::string op = OpName(r.op_id);
  const std::string me = "rank " + std::to_string(r.rank);
  const std::string where =
      "jax_ep: " + op + " on GPU " + std::to_string(r.device_ordinal) + " (" + me + "): ";
  const std::string peer = "rank " + std::to_string(r.waited_rank);
  const std::string peer_device =
      r.waited_ordinal < 0 ? std::string("GPU not known yet: group discovery")
      : per_process        ? "process " + std::to_string(r.waited_ordinal)
                           : "GPU " + std::to_string(r.waited_ordinal);
  switch (r.kind) {
    case kFaultTimeout: {
      const std::string elapsed = std::to_string(static_cast<double>(r.elapsed_ns) * 1e-9) + " s";
      if (r.field == kFieldPrepBlocks) {
        return where + "timed out after " + elapsed + " waiting for its own prep blocks: " +
               Str(r.observed) + " of " + Str(r.expected) +
               " ran. No peer is late: this GPU did not schedule the call's blocks (another kernel "
               "holding its SMs, e.g. a process sharing the GPU, or KernelConfig.num_sms above what "
               "it can run at once).";
      }
      if (r.field == kFieldFingerprintWords) {
        return where + "timed out after " + elapsed + " reading the configuration of " + peer +
               " (" + peer_device + ") for EP call " + Str(r.expected) +
               ": its entry for this call arrived but its configuration words "
               "still held those of call " + Str(r.observed) + " (the peer died or its GPU was "
               "reset while publishing them). Nothing was exchanged.";
      }
      std::string text = "jax_ep: " + op + " on GPU " + std::to_string(r.device_ordinal) + " (" +
                         me + ") timed out after " + elapsed + " waiting for " + peer + " (" +
                         peer_device + ")";
      if (r.field == kFieldSequence && r.observed < r.expected) {
        // group discovery: the peer's call count in the group stayed below this call's
        const uint64_t behind = r.expected - r.observed;
        text += " to enter this call: this is EP call " + Str(r.expected) + " of the group on " +
                me + ", " + peer + " has entered " + Str(r.observed) + " (it is " + Str(behind) +
                (behind == 1 ? " call" : " calls") + " behind: it has not issued this call, or "
                "issued fewer EP calls before it; a rank that is behind looks like a slow one "
                "until the timeout).";
      } else if (r.field == kFieldForeignFlag) {
        text += ": it expected the flag of its call " + Str(r.expected) + " and found none of this "
                "EP group there (nothing yet, or another call site's data).";
      } else {
        text += ": it expected barrier epoch " + Str(r.expected) + " and saw " + Str(r.observed) +
                ".";
      }
      return text + " Every rank must issue the same EP calls in the same order; a rank that is "
                    "alive but busy on its host longer than the bound (compiling, writing a "
                    "checkpoint) looks the same: raise JAX_EP_TIMEOUT_S.";
    }
    case kFaultMismatch:
      if (r.field == kFieldSequence) {
        return where + "the ranks' EP calls are out of step: this is EP call " + Str(r.expected) +
               " of the group on " + me + ", and " + peer + " (" + peer_device +
               ") has entered call " + Str(r.observed) + " (call_sequence " + Str(r.expected) +
               " here, " + Str(r.observed) + " on " + peer + ": it issued EP calls in this "
               "group that " + me + " did not). Every rank must issue the same EP calls in the "
               "same order; nothing was exchanged.";
      }
      return where + peer + " (" + peer_device + ") runs a different EP call at this point: " +
             FingerprintFieldName(r.field) + " is " + FieldValue(r.field, r.expected) + " on " +
             me + " and " + FieldValue(r.field, r.observed) + " on " + peer + ". Every rank "
             "must issue the same EP calls, with the same configuration, in the same order; "
             "nothing was exchanged." +
             (r.field != kFieldTransport ? ""
              : r.expected == kTransportPull || r.observed == kTransportPull
                  ? " (give every process the same explicit KernelConfig.dispatch_pull and "
                    "broadcast_pull: None resolves in each process from its auto table and its "
                    "GPU's SM count.)"
                  : " (KernelConfig.transport: \"auto\" picks puts in a process that some "
                    "process of the job cannot reach by loads / stores; give every process the "
                    "same explicit transport.)");
    case kFaultLLInFlight:
      return LLInFlightMessage(where, r.waited_ordinal, r.expected, r.observed);
    case kFaultBadArgument:
      return "jax_ep: " + op + " on GPU " + std::to_string(r.device_ordinal) + " got rank " +
             std::to_string(r.rank) + " / group " + Str(r.observed) + " outside [0, " +
             Str(r.expected) + ") / [0, " + std::to_string(kMaxGroups) +
             "): the op must run inside shard_map over its EP mesh axis.";
    default:
      return where.substr(0, where.size() - 2) + " ran after shutdown() or with a too small "
             "communication buffer: needs " + Str(r.expected) + " bytes, " + Str(r.observed) +
             " available.";
  }
}

}  // namespace jax_ep
