"""Whether a CUDA MPS control daemon answers (processes sharing a GPU need one: ``jax_ep.launch``).

Standard library only, so that a shell script can ask without importing JAX (2-3 s an import):
``python -c 'import runpy; runpy.run_path("jax_ep/mps.py", run_name="__main__")'`` prints why none
answers and exits 0, or exits 1 when one does (tools/gpu_check.sh).
"""

from __future__ import annotations

import errno
import os
import pathlib
import socket
import stat
import sys


def mps_control_pipe() -> pathlib.Path:
    """The control pipe of the CUDA MPS daemon this user's CUDA processes would connect to."""
    return pathlib.Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps") / "control"


def mps_unavailable(pipe: pathlib.Path | None = None) -> str | None:
    """Why no CUDA MPS control daemon answers at ``pipe`` (default ``mps_control_pipe()``), or None when
    one does. The pipe's existence proves nothing: a stopped daemon leaves its control socket behind,
    and CUDA then runs its clients without MPS, silently (seen on one H200, 2026-12-01: processes
    sharing the GPU took turns on it, and a test whose kernels trap hung). So this connects to it."""
    pipe = pipe or mps_control_pipe()
    try:
        mode = pipe.stat().st_mode
    except FileNotFoundError:
        return f"no control pipe {pipe}"
    except OSError as e:   # its folder is a file, or another user's: no daemon this process can use
        return f"cannot read the control pipe {pipe} ({e.strerror or e})"
    stale = "a stopped daemon left it behind"

    def refused(what: str, e: OSError) -> str:
        # a stopped daemon's leftover answers ECONNREFUSED / ENXIO; EACCES is a live daemon's pipe that
        # this user may not use (another user's daemon), not a stopped one
        if e.errno in (errno.EACCES, errno.EPERM):
            return (f"its control {what} {pipe} is not accessible to this user ({e.strerror}; owned by uid "
                    f"{pipe.stat().st_uid}, this process runs as uid {os.getuid()})")
        failure = "refuses connections" if what == "socket" else "has no reader"
        return f"its control {what} {pipe} {failure} ({e.strerror or e}): {stale}"
    if stat.S_ISSOCK(mode):   # CUDA 13's daemon: a UNIX socket
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5.0)
            try:
                s.connect(str(pipe))
            except OSError as e:
                # EPROTOTYPE: a socket of another type is bound at the path, and only a live process holds
                # one (H200, CUDA 13, 2026-12-01: the daemon's is not a stream socket); a stopped daemon's
                # file has none bound (ECONNREFUSED). Nothing is sent to the daemon either way.
                if e.errno == errno.EPROTOTYPE:
                    return None
                return refused("socket", e)
        return None
    if stat.S_ISFIFO(mode):   # a named pipe, held open for reading while its daemon runs
        try:
            os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as e:
            return refused("pipe", e)
        return None
    return f"{pipe} is neither a socket nor a named pipe"


if __name__ == "__main__":
    try:
        why = mps_unavailable()
    except Exception as e:  # noqa: BLE001 - an uncaught error exits 1, which reads as "a daemon answers"
        why = f"the MPS check failed: {type(e).__name__}: {e}"
    print(why or "")
    sys.exit(why is None)
