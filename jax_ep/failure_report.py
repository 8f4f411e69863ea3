"""What one process of a multi-process run printed, boiled down to what diagnoses its failure.

A device fault in a jax_ep kernel (a timeout, ranks running different EP calls) kills the GPU's CUDA
context; the process then fails with a CUDA error, and XLA logs hundreds of lines while it tears the
client down (``cuda_stream.cc``, ``cuda_event.cc``, ... one per stream, event and buffer it cannot
free). Those lines used to bury what the process said about the failure. ``OutputDigest`` reads a
process's output a line at a time, keeps a bounded summary and tail, and ``report`` gives, first,

* the process and how it ended (exit code or signal),
* the failing check: the worker's ``check NAME failed`` line and the exception of its first
  traceback (the raised one, and its cause when chained), else the first error-looking line,
* the jax_ep fault records it printed (``jax_ep.runtime.faults()`` / ``check_errors()``: every text
  of the form ``jax_ep: OP on GPU N ...``, from a repr of the records, JSON or an exception),
* the first CUDA / XLA error line (``CUDA_ERROR_*``, ``cudaError*``, ``INTERNAL:``,
  ``XlaRuntimeError``, ...),
* the EP op that was running (from the fault record; else a ``jax_ep_<op>`` custom call an error
  names),
* how many lines of XLA teardown noise were left out,

then the last lines of the output without the noise. ``python -m jax_ep.launch`` prints it for every
process that did not exit 0 when a run fails; the multi-process GPU tests (tests/gpu/gpu_helpers.py)
print it for every process of a failed run. Pure Python: no JAX, no CUDA.
"""

from __future__ import annotations

import ast
import collections
import re

# ---- what a line is --------------------------------------------------------------------------------

_PROCESS_PREFIX = re.compile(r"^\[p\d+\] ?")           # python -m jax_ep.launch's [pI] prefix
# absl's log prefix, as XLA writes it: E1128 12:34:56.789012  123456 cuda_stream.cc:123] message
_ABSL = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+\s+(\S+?):\d+\]\s?")
# XLA's files that log one line per stream, event, buffer and allocation it cannot free at teardown
_TEARDOWN_FILES = re.compile(r"\bcuda_(?:stream|event|executor|host_allocator|device_allocator|status|"
                             r"driver|timer)\.cc|(?<!\w)stream_executor/\S*\.cc|\bstream_executor_pimpl")
# teardown messages of any XLA file (absl-prefixed lines only)
_TEARDOWN_MESSAGE = re.compile(r"\b(?:Failed to|Unable to|could not|Could not|Error) "
                               r"(?:destroy|deallocate|free|unload|unregister|release|delete|unmap)|"
                               r"\bError (?:destroying|deallocating|freeing|releasing)\b")
_SOURCE_TRACE = re.compile(r"=== Source Location Trace: ===|^\s*(?:external/)?[\w.+-]+(?:/[\w.+-]+)*"
                           r"\.(?:cc|h|cpp|cu):\d+\s*$")
# a Python exception line (never noise): builtins.AssertionError: ..., jaxlib._jax.XlaRuntimeError: ...
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure|"
                        r"Traceback)\b(?::|$)")
_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
# the first exception of JAX's chained tracebacks says nothing about the failure
_JAX_FRAMES_NOTE = re.compile(r"SimplifiedTraceback|UnfilteredStackTrace|JAX has removed its internal")
_ERROR_LIKE = re.compile(r"^(?:E\s+)?(?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception)\b:|\bFAILED\b|"
                         r"^Fatal Python error|\bCheck failed\b")
_CUDA_XLA_ERROR = re.compile(r"CUDA_ERROR_\w+|cudaError\w*|\bCUDA error\b|\bINTERNAL: |XlaRuntimeError|"
                             r"JaxRuntimeError|\bRESOURCE_EXHAUSTED\b|illegal (?:memory access|"
                             r"instruction)|unspecified launch failure|\bCheck failed\b")
# a jax_ep fault record's text (xla_ffi/fault_message.cc): "jax_ep: <op> on GPU <n> ..."
_FAULT = re.compile(r"jax_ep: ([a-z][a-z0-9_]*) on GPU \d+")
_MISMATCHED_OP = re.compile(r"op is \w+ on rank \d+ and \w+ on rank \d+")
_CUSTOM_CALL = re.compile(r"\bjax_ep_([a-z][a-z0-9_]*)\b")
_NOT_AN_OP = {"op_state", "side_join"}
_TARGET_VARIANT = re.compile(r"_(?:uncaptured|side)$")   # runtime.target's variants of one op
_WORKER_REPORT = re.compile(r"\bcheck \S+ failed\b")

# gloo's connection messages (jax.distributed's CPU collectives: one per rank and communicator, ~23 lines for
# a 2-process training run): "[Gloo] Rank 1 is connected to 7 peer ranks. Expected number of connected peer
# ranks is : 7". Several threads write them piece by piece at once, so a line can hold pieces of two
# messages ("[Gloo] Rank 7 is connected to [Gloo] Rank 6 is connected to 7 peer ranks. ...") or only a
# message's end ("7 peer ranks. Expected ..."): a line made of nothing but such pieces is chatter.
_GLOO_PIECES = re.compile(r"(?:\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer "
                          r"ranks is :|\d|\s)+")
_GLOO_WORDS = ("[Gloo] Rank", "connected peer ranks", "is connected to")

ITEM_CHARS = 400            # each line of the summary at most
FAULT_CHARS = 1000          # a fault record at most: the longest (~530) end with their advice
MAX_FAULTS = 3              # distinct fault records shown (the rest counted)


def strip_prefix(line: str) -> str:
    """The line without the launcher's ``[pI] `` prefix."""
    return _PROCESS_PREFIX.sub("", line, count=1)


def is_teardown_noise(line: str) -> bool:
    """One of the lines XLA logs while it tears a client down after a device fault (``[pI]`` prefix or
    not): a line of XLA's CUDA stream / event / executor / allocator files, a 'Failed to destroy /
    deallocate ...' log line, a source location trace, or a blank launcher line. Python's exception
    lines and anything naming jax_ep are never noise."""
    text = strip_prefix(line)
    if not text.strip():
        return _PROCESS_PREFIX.match(line) is not None
    if _EXCEPTION.match(text) or "jax_ep" in text or text.startswith(_TRACEBACK):
        return False
    if _SOURCE_TRACE.search(text) or _TEARDOWN_FILES.search(text):
        return True
    return bool(_ABSL.match(text) and _TEARDOWN_MESSAGE.search(text))


def is_transport_chatter(line: str) -> bool:
    """One of gloo's connection messages (``[Gloo] Rank N is connected to M peer ranks. Expected number of
    connected peer ranks is : M``), whole or in pieces (several threads write them at once), with the
    launcher's ``[pI]`` prefix or not. ``python -m jax_ep.launch`` leaves them out of its output unless
    ``--verbose``. Any other text on the line (a gloo error, say) keeps it."""
    text = strip_prefix(line).strip()
    return any(word in text for word in _GLOO_WORDS) and _GLOO_PIECES.fullmatch(text) is not None


def without_teardown_noise(text: str) -> str:
    """``text`` without its teardown noise (is_teardown_noise), with a line saying how many lines were
    left out when some were."""
    lines = text.splitlines()
    kept = [line for line in lines if not is_teardown_noise(line)]
    if len(kept) < len(lines):
        kept.append(f"({len(lines) - len(kept)} lines of XLA teardown errors left out)")
    return "\n".join(kept)


def _short(text: str, limit: int = ITEM_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit - 5] + " ...]"


def _quoted(text: str, start: int) -> str | None:
    """The Python / JSON string literal whose opening quote is text[start], unescaped (None: none)."""
    quote = text[start]
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == quote:
            try:
                value = ast.literal_eval(text[start:i + 1])
            except (ValueError, SyntaxError):
                return None
            return value if isinstance(value, str) else None
        i += 1
    return None


def fault_texts(line: str) -> list[str]:
    """The jax_ep fault record texts in one line: inside a repr / JSON of ``runtime.faults()`` (the
    'message' strings), or the rest of the line (check_errors()'s DeviceFaultError)."""
    found = []
    position = 0
    while True:
        match = _FAULT.search(line, position)
        if match is None:
            return found
        start = match.start()
        text = _quoted(line, start - 1) if start and line[start - 1] in "'\"" else None
        if text is None:
            text = line[start:]
        found.append(text.strip())
        position = start + max(len(text), 1)


# ---- one process's output ---------------------------------------------------------------------------

class _TracebackReader:
    """The exception lines of the first traceback (with its chained ones) of one output stream."""

    def __init__(self):
        self.exceptions: list[str] = []
        self.state = "out"          # out, frames, after (an exception line), chained, done
        self.continuation = 0       # lines of a message that starts on the line after the exception's
        self.embedded = False       # the exception's message holds a traceback (a JAX callback's)

    def _exception(self, text: str) -> None:
        self.exceptions.append(_short(text))
        self.state, self.continuation = "after", 3 if text.rstrip().endswith(":") else 0
        # "JaxRuntimeError: ... CpuCallback error calling callback: Traceback (most recent call last):",
        # then the callback's frames and its exception (checked mode's "EPValueError: <message>")
        self.embedded = text.rstrip().endswith(_TRACEBACK)
        if self.embedded:
            self.continuation = 0

    def feed(self, text: str) -> None:
        state = self.state
        if state == "done":
            return
        if text.startswith(_TRACEBACK):
            self.state = "done" if state == "after" else "frames"   # after: another, unchained one
        elif state == "frames":
            # other threads' lines between the frames: XLA's absl log, the fault watcher's records
            if text.strip() and not text[:1].isspace() and not _ABSL.match(text) \
                    and not text.startswith("jax_ep device fault:"):
                self._exception(text)
        elif state in ("after", "chained"):
            if text.startswith(_CHAINED):
                self.state = "chained"
            elif state == "after" and self.embedded and _EXCEPTION.match(text):
                self._exception(text)       # the embedded traceback's exception
            elif state == "after" and self.continuation and text.strip() and not _ABSL.match(text):
                self.continuation -= 1      # numpy.testing's messages start on the next line
                self.exceptions[-1] = _short(self.exceptions[-1] + " | " + text.strip())
            # other lines after an exception (its message's further lines, the embedded traceback's
            # frames) are skipped: a chained exception may follow; an unchained traceback ends it


class OutputDigest:
    """What one process printed, fed a line at a time (``feed``), kept bounded: the first traceback's
    exceptions, the fault records, the first CUDA / XLA error, the op, the worker's reports, the count
    of teardown noise lines and the last ``tail_lines`` other lines."""

    def __init__(self, tail_lines: int = 200):
        self.lines = 0                        # lines other than noise and blank ones
        self.noise = 0
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.error_like: str | None = None    # the first error-looking line (no traceback)
        self.faults: list[str] = []           # distinct fault record texts (first MAX_FAULTS)
        self.more_faults = 0
        self.fault_op: str | None = None
        self.mismatched_op: str | None = None
        self.first_error: str | None = None
        self.call_op: str | None = None       # a jax_ep_<op> custom call an error line names
        self.reports: list[str] = []          # the worker's "check NAME failed" lines (first 2)
        # one traceback reader per output stream (the launcher reads stdout and stderr apart: their
        # lines interleave); the first traceback is the first stream's that had one
        self._readers: dict[object, _TracebackReader] = {}

    @property
    def exceptions(self) -> list[str]:
        """The exception lines of the first traceback (its chain: cause first, raised one last)."""
        started = [r for r in self._readers.values() if r.state != "out"]
        return started[0].exceptions if started else []

    # -- feeding --
    def feed(self, line: str, stream: object = None) -> None:
        """One line of the output (``[pI]`` prefix or not); ``stream``: which of the process's streams it
        comes from, when they are read apart (e.g. "stdout" / "stderr")."""
        line = line.rstrip("\r\n")
        text = strip_prefix(line)
        noise = is_teardown_noise(line)
        if noise and text.strip():
            self.noise += 1
        if self.first_error is None and _CUDA_XLA_ERROR.search(text):
            self.first_error = _short(text)
        if self.call_op is None and _CUDA_XLA_ERROR.search(text):
            ops = [_TARGET_VARIANT.sub("", m) for m in _CUSTOM_CALL.findall(text) if m not in _NOT_AN_OP]
            self.call_op = ops[0] if ops else None
        if noise:
            return
        if text.strip():
            self.lines += 1
            self.tail.append(line)
        for fault in fault_texts(text):
            self._add_fault(fault)
        if len(self.reports) < 2 and _WORKER_REPORT.search(text):
            self.reports.append(_short(text.split("; jax_ep faults:")[0]))
        reader = self._readers.get(stream)
        if reader is None and text.startswith(_TRACEBACK):
            reader = self._readers[stream] = _TracebackReader()
        if reader is not None:
            reader.feed(text)
        elif self.error_like is None and _ERROR_LIKE.search(text):
            self.error_like = _short(text)

    def feed_text(self, text: str) -> OutputDigest:
        for line in text.splitlines():
            self.feed(line)
        return self

    def _add_fault(self, text: str) -> None:
        if text in self.faults:
            return
        if any(text in known or known in text for known in self.faults):   # a cut copy of one known
            return
        if self.fault_op is None:
            self.fault_op = _FAULT.match(text).group(1)
            mismatch = _MISMATCHED_OP.search(text)
            self.mismatched_op = mismatch.group(0) if mismatch else None
        if len(self.faults) < MAX_FAULTS:
            self.faults.append(text)
        else:
            self.more_faults += 1

    # -- results --
    def failing_check(self) -> list[str]:
        """The worker's report and the exception(s) of its first traceback (cause, then the raised
        one), else the first error-looking line."""
        exceptions = [e for e in self.exceptions if not _JAX_FRAMES_NOTE.search(e)] or self.exceptions
        found = self.reports + exceptions[-2:]
        if not exceptions and self.error_like:
            found.append(self.error_like)
        return found

    def op(self) -> str | None:
        """The EP op that was running, and where that comes from; None when nothing names it."""
        if self.fault_op is not None:
            detail = f"; {self.mismatched_op}" if self.mismatched_op else ""
            return f"{self.fault_op} (its fault record{detail})"
        if self.call_op is not None:
            return f"{self.call_op} (the custom call jax_ep_{self.call_op} in an error line)"
        return None

    def failed(self) -> bool:
        """Whether the output shows a failure (a traceback, a fault record or a CUDA / XLA error)."""
        return bool(self.exceptions or self.faults or self.first_error or self.reports)

    def summary(self, process: int, status: str | None = None) -> str:
        """The summary block of process ``process``; ``status``: how it ended (e.g. 'exited with code
        1'), None when not known."""
        lines = [f"==== process {process}: {status or 'exit status not known'} ===="]
        check = self.failing_check()
        lines.append("failing check: " + (check[0] if check else "none found (no traceback, no error line)"))
        lines += ["  " + c for c in check[1:]]
        if self.faults:
            lines.append("jax_ep fault records:")
            lines += ["  " + _short(f, FAULT_CHARS) for f in self.faults]
            if self.more_faults:
                lines.append(f"  ({self.more_faults} more)")
        else:
            lines.append("jax_ep fault records: none printed")
        lines.append("first CUDA/XLA error: " + (self.first_error or "none"))
        lines.append("EP op running: " + (self.op() or "not named"))
        if self.noise:
            lines.append(f"({self.noise} lines of XLA teardown errors left out)")
        return "\n".join(lines)

    def report(self, process: int, status: str | None = None, tail_chars: int = 2500,
               total_chars: int | None = None) -> str:
        """summary(), then the last lines of the output without the teardown noise, at most
        ``tail_chars`` characters of them; with ``total_chars``, as many as keep the whole report
        within it (at least 1000 characters of them: a long summary still comes whole, first)."""
        summary = self.summary(process, status)
        if total_chars is not None:
            tail_chars = max(1000, total_chars - len(summary) - 150)
        kept: list[str] = []
        size = 0
        for line in reversed(list(self.tail)):   # a copy: the launcher's pump threads may still feed
            if size + len(line) + 1 > tail_chars and kept:
                break
            kept.append(line[-tail_chars:])
            size += len(line) + 1
        left = self.lines - len(kept)
        head = [summary,
                f"---- process {process}: the last {len(kept)} lines of its output without teardown noise"
                + (f" ({left} lines before them left out)" if left > 0 else "") + " ----"]
        return "\n".join(head + kept[::-1])


def digest(text: str, tail_lines: int = 200) -> OutputDigest:
    """An OutputDigest of a whole output."""
    return OutputDigest(tail_lines).feed_text(text)


def report(text: str, process: int, status: str | None = None, tail_chars: int = 2500,
           total_chars: int | None = None) -> str:
    """The failure report of one process's whole output (OutputDigest.report)."""
    return digest(text).report(process, status, tail_chars, total_chars)
