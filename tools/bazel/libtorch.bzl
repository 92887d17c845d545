"""The @libtorch repository: Debian's LibTorch under /usr by default, or the one STAGEWISE_LIBTORCH names.

    STAGEWISE_LIBTORCH=/opt/libtorch ./bazelw build ...     # an official LibTorch archive
    STAGEWISE_LIBTORCH=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))') \\
        ./bazelw build --define=stagewise_cuda=1 ...         # the LibTorch inside Python's torch wheel

Like new_local_repository(path = PREFIX, build_file = ...): every entry of PREFIX is linked into the
repository and the build file is copied in. For a PREFIX other than /usr (whose headers and libraries
the compiler and linker find on their own) the build file's PREFIX_INCLUDES and PREFIX_LINKOPTS are
filled in: PREFIX/include on the include path, PREFIX/lib on the library path and the run path.
A LibTorch with CUDA also needs --define=stagewise_cuda=1 (see //tools/bazel:cuda); its CUDA headers
(cuda_runtime_api.h) come from STAGEWISE_CUDA_HOME/include (default /usr/local/cuda) when that exists.
"""

def _libtorch_repository_impl(ctx):
    prefix = ctx.os.environ.get("STAGEWISE_LIBTORCH", "").rstrip("/") or "/usr"
    root = ctx.path(prefix)
    if not root.exists:
        fail("STAGEWISE_LIBTORCH=%s: no such directory; name LibTorch's prefix (the directory " % prefix +
             "holding include/ and lib/)")
    for child in root.readdir():
        if child.basename not in ["BUILD", "BUILD.bazel", "WORKSPACE"]:
            ctx.symlink(child, child.basename)
    cuda = ctx.os.environ.get("STAGEWISE_CUDA_HOME", "").rstrip("/") or "/usr/local/cuda"
    if ctx.path(cuda + "/include/cuda_runtime_api.h").exists:
        ctx.symlink(cuda + "/include", "stagewise_cuda_include")

    build = ctx.read(ctx.path(ctx.attr.build_file))
    if prefix != "/usr":
        if not ctx.path(prefix + "/include/torch/csrc/api/include/torch/torch.h").exists:
            fail("STAGEWISE_LIBTORCH=%s holds no include/torch/csrc/api/include/torch/torch.h: " % prefix +
                 "name LibTorch's prefix (for Python's torch, the directory of torch/__init__.py)")
        lib = prefix + "/lib"
        build = build.replace("PREFIX_INCLUDES = []", 'PREFIX_INCLUDES = ["include"]', 1)
        build = build.replace(
            "PREFIX_LINKOPTS = []",
            'PREFIX_LINKOPTS = ["-L%s", "-Wl,-rpath,%s"]' % (lib, lib),
            1,
        )
    ctx.file("BUILD.bazel", build)
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)

libtorch_repository = repository_rule(
    implementation = _libtorch_repository_impl,
    attrs = {"build_file": attr.label(allow_single_file = True, mandatory = True)},
    environ = ["STAGEWISE_LIBTORCH", "STAGEWISE_CUDA_HOME"],
    local = True,
)
