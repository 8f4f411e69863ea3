"""Repository rule finding every native dependency of jax_ep on the local machine (no downloads).

It runs the Python interpreter (JAX_EP_PYTHON, else PYTHON_BIN_PATH, else python3 on PATH) to
locate the Python headers, jaxlib's XLA FFI headers (jax.ffi.include_dir()), the nanobind pip
package and the NVSHMEM wheel (nvidia-nvshmem-cu13), and finds the CUDA toolkit through CUDA_HOME / CUDA_PATH, nvcc on PATH, or
/usr/local/cuda. The repository links to those directories and defines cc targets for them.
"""

_FIND_PYTHON_DEPS = """
import json, os, sysconfig
try:
    import jax.ffi
    ffi_include = jax.ffi.include_dir()
except Exception:
    import jaxlib
    ffi_include = os.path.join(jaxlib.__path__[0], "include")
import nanobind
try:
    import nvidia.nvshmem
    nvshmem = list(nvidia.nvshmem.__path__)[0]
except ImportError:
    nvshmem = ""
print(json.dumps({
    "nvshmem": nvshmem,
    "python_include": sysconfig.get_paths()["include"],
    "ffi_include": ffi_include,
    "nanobind": os.path.dirname(nanobind.include_dir()),
}))
"""

def _fail_unless_exists(ctx, path, what):
    if not ctx.path(path).exists:
        fail("jax_ep_local_deps: %s not found at %s" % (what, path))

def _find_python(ctx):
    for var in ("JAX_EP_PYTHON", "PYTHON_BIN_PATH"):
        value = ctx.os.environ.get(var, "")
        if not value:
            continue
        if "/" not in value:  # a bare name: the one on PATH
            python = ctx.which(value)
            if python == None:
                fail("jax_ep_local_deps: %s=%s is not on PATH" % (var, value))
            return str(python)
        if not value.startswith("/"):
            # ctx.execute runs it from this repository's directory, where a relative path is wrong.
            fail("jax_ep_local_deps: %s=%s is a relative path; give an absolute one " % (var, value) +
                 "(tools/bazel_build.sh makes JAX_EP_PYTHON absolute)")
        return value
    python = ctx.which("python3")
    if python == None:
        fail("jax_ep_local_deps: no python3 on PATH; set JAX_EP_PYTHON to the interpreter " +
             "that has jaxlib and nanobind installed")
    return str(python)

def _nvcc_toolkit_root(ctx):
    """The toolkit the nvcc on PATH belongs to (nvcc may be a wrapper script or a symlink)."""
    nvcc = ctx.which("nvcc")
    if nvcc == None:
        return None
    dryrun = ctx.execute([str(nvcc), "--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"])
    for line in (dryrun.stdout + dryrun.stderr).splitlines():
        if "TOP=" in line:
            return line.split("TOP=", 1)[1].strip()
    return str(nvcc.dirname.dirname)

def _find_cuda(ctx):
    candidates = [ctx.os.environ.get(var, "") for var in ("CUDA_HOME", "CUDA_PATH")]
    candidates.append(_nvcc_toolkit_root(ctx))
    candidates.append("/usr/local/cuda")
    for root in candidates:
        if root and ctx.path(root + "/include/cuda_runtime_api.h").exists:
            return str(ctx.path(root))
    fail("jax_ep_local_deps: no CUDA toolkit found (tried %s); set CUDA_HOME" % candidates)

def _jax_ep_local_deps_impl(ctx):
    python = _find_python(ctx)
    result = ctx.execute([python, "-c", _FIND_PYTHON_DEPS])
    if result.return_code != 0:
        fail("jax_ep_local_deps: %s cannot locate jaxlib/nanobind:\n%s" % (python, result.stderr))
    paths = json.decode(result.stdout.strip())

    cuda = _find_cuda(ctx)
    _fail_unless_exists(ctx, cuda + "/bin/nvcc", "nvcc (set CUDA_HOME)")
    _fail_unless_exists(ctx, cuda + "/include/cuda_runtime_api.h", "the CUDA headers")
    cudart = None
    for lib in ("lib64", "lib", "targets/x86_64-linux/lib"):
        if ctx.path(cuda + "/" + lib + "/libcudart_static.a").exists:
            cudart = lib + "/libcudart_static.a"
            break
    if cudart == None:
        fail("jax_ep_local_deps: libcudart_static.a not found under " + cuda)
    _fail_unless_exists(ctx, paths["ffi_include"] + "/xla/ffi/api/ffi.h", "the XLA FFI headers")
    _fail_unless_exists(ctx, paths["python_include"] + "/Python.h", "Python.h")
    _fail_unless_exists(ctx, paths["nanobind"] + "/src/nb_combined.cpp", "nanobind's sources")

    if not paths["nvshmem"]:
        fail("jax_ep_local_deps: %s has no NVSHMEM wheel (pip install nvidia-nvshmem-cu13)" % python)
    _fail_unless_exists(ctx, paths["nvshmem"] + "/include/nvshmem_host.h", "NVSHMEM's headers")
    _fail_unless_exists(ctx, paths["nvshmem"] + "/lib/libnvshmem_host.so.3", "libnvshmem_host.so.3")
    _fail_unless_exists(ctx, paths["nvshmem"] + "/lib/libnvshmem_device.a", "libnvshmem_device.a")
    _fail_unless_exists(ctx, cuda + "/include/cccl/cuda/std/version",
                        "CUDA's CCCL headers (include/cccl, needed by NVSHMEM's device headers)")

    ctx.symlink(cuda, "cuda")
    ctx.symlink(paths["nvshmem"], "nvshmem")
    ctx.symlink(paths["python_include"], "python_include")
    ctx.symlink(paths["ffi_include"], "ffi_include")
    ctx.symlink(paths["nanobind"], "nanobind")
    ctx.template("BUILD.bazel", ctx.attr._build_template, {
        "%{CUDART_STATIC}": "cuda/" + cudart,
        "%{NVSHMEM_LIB}": paths["nvshmem"] + "/lib",
    })
    ctx.file("paths.txt", "python: %s\ncuda: %s\n%s\n" % (python, cuda, result.stdout))

jax_ep_local_deps = repository_rule(
    implementation = _jax_ep_local_deps_impl,
    attrs = {"_build_template": attr.label(default = Label("//bazel:local_deps.BUILD.tpl"))},
    environ = ["JAX_EP_PYTHON", "PYTHON_BIN_PATH", "CUDA_HOME", "CUDA_PATH", "PATH"],
    local = True,
)
