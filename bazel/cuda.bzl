"""nvcc from bazel: one genrule per .cu file, producing a position-independent object."""

# Same targets as the CMake build: sm_90a machine code (H100/H200) + compute_90 PTX for newer GPUs.
CUDA_GENCODE = [
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90,code=compute_90",
]

NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-DNDEBUG",
    "-Xcompiler=-fPIC,-fvisibility=hidden,-Wall,-Wextra",
    "-I.",  # the execroot: sources include "cuda/..." like the CMake build
]

def cuda_objects(name, srcs, hdrs):
    """Compiles each of `srcs` with nvcc; returns the list of .pic.o labels (for a cc_library)."""
    objects = []
    for src in srcs:
        stem = src.split("/")[-1].rsplit(".", 1)[0]
        out = "_%s_objs/%s.pic.o" % (name, stem)
        native.genrule(
            name = "%s_%s" % (name, stem),
            srcs = [src] + hdrs,
            outs = [out],
            tools = ["@jax_ep_deps//:nvcc"],
            cmd = " ".join(
                ["$(location @jax_ep_deps//:nvcc)"] + NVCC_FLAGS + CUDA_GENCODE +
                ["-c", "$(location %s)" % src, "-o", "$@"],
            ),
            message = "nvcc " + src,
        )
        objects.append(out)
    return objects
