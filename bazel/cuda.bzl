"""nvcc from bazel: one genrule per .cu file, producing a position-independent object, and the
device link of relocatable device code (kernels that call NVSHMEM device functions)."""

# Same targets as the CMake build: sm_90a machine code (H100/H200) + compute_90 PTX for newer GPUs.
CUDA_GENCODE = [
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90,code=compute_90",
]

# Relocatable device code (CMake: JAX_EP_RDC_GENCODE): machine code only, since nvlink cannot link
# PTX; sm_90a links with the sm_90 code of NVSHMEM's device library.
RDC_GENCODE = ["-gencode=arch=compute_90a,code=sm_90a"]

NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-DNDEBUG",
    "-lineinfo",  # as CMake: source lines for profilers (ncu's source view)
    "-Xcompiler=-fPIC,-fvisibility=hidden,-Wall,-Wextra",
    "-I.",  # the execroot: sources include "cuda/..." like the CMake build
]

# The local dependencies' repository (//bazel:local_deps.bzl) as the genrules see it.
_DEPS_ROOT = Label("@jax_ep_deps//:nvshmem_host").workspace_root

# What the kernels of cuda/remote.cu include: NVSHMEM's headers (the wheel's), and with CUDA 13
# the CCCL headers they need (cuda/std/...).
NVSHMEM_NVCC_FLAGS = [
    "-isystem",
    _DEPS_ROOT + "/nvshmem/include",
    "-isystem",
    _DEPS_ROOT + "/cuda/include/cccl",
]

def cuda_objects(name, srcs, hdrs, rdc = False, gencode = CUDA_GENCODE, extra_flags = [],
                 extra_srcs = []):
    """Compiles each of `srcs` with nvcc; returns the list of .pic.o labels (for a cc_library).

    rdc: relocatable device code (-rdc=true); the objects then need cuda_device_link."""
    objects = []
    for src in srcs:
        stem = src.split("/")[-1].rsplit(".", 1)[0]
        out = "_%s_objs/%s.pic.o" % (name, stem)
        native.genrule(
            name = "%s_%s" % (name, stem),
            srcs = [src] + hdrs + extra_srcs,
            outs = [out],
            tools = ["@jax_ep_deps//:nvcc"],
            cmd = " ".join(
                ["$(location @jax_ep_deps//:nvcc)"] + NVCC_FLAGS + extra_flags + gencode +
                (["-rdc=true"] if rdc else []) +
                ["-c", "$(location %s)" % src, "-o", "$@"],
            ),
            message = "nvcc " + src,
        )
        objects.append(out)
    return objects

def cuda_device_link(name, objects, archives, gencode = RDC_GENCODE):
    """nvcc -dlink of relocatable `objects` together with the device code of the static libraries
    `archives` (labels of .a files): one device link, one linked cubin. Returns the label of the
    resulting .pic.o, which a cc_library lists beside `objects`; the archives' host objects must
    follow it in the final link (a cc_library dep)."""
    out = "_%s_objs/%s_dlink.pic.o" % (name, name)
    native.genrule(
        name = name,
        srcs = objects + archives,
        outs = [out],
        tools = ["@jax_ep_deps//:nvcc"],
        cmd = " ".join(
            # hidden: the registration functions of the link (__cudaRegisterLinkedBinary_<module
            # id>, called by libnvshmem_device.a's host objects) must never be exported, or
            # another library built from the same NVSHMEM (DeepEP) could interpose them.
            ["$(location @jax_ep_deps//:nvcc)", "-dlink", "-Xcompiler=-fPIC,-fvisibility=hidden"] +
            gencode +
            ["$(location %s)" % o for o in objects] +
            ["$(location %s)" % a for a in archives] + ["-o", "$@"],
        ),
        message = "nvcc -dlink " + name,
    )
    return out
