"""Build helpers for stagewise: doctest targets, header self-containment, must-not-compile tests."""

def sw_test(name, srcs = None, deps = [], size = "small", **kwargs):
    """A doctest test binary built from `<name>.cpp` against //:stagewise."""
    native.cc_test(
        name = name,
        srcs = srcs or [name + ".cpp"],
        deps = ["//:stagewise", "//tests:doctest_main", "//tests:support"] + deps,
        size = size,
        # Static: doctest's main and the sanitizer settings (//tests/sanitizers:defaults, through
        # //tests:doctest_main) live in the executable, where the sanitizer runtimes find them.
        linkstatic = True,
        **kwargs
    )

def header_self_containment(name, hdrs, deps = ["//:stagewise"]):
    """For each header, a generated .cpp that includes it twice, compiled as its own target."""
    targets = []
    for hdr in hdrs:
        include = hdr[len("include/"):]
        stem = include.replace("/", "_").replace(".", "_")
        src = name + "/" + stem + ".cpp"
        native.genrule(
            name = stem + "_src",
            outs = [src],
            cmd = "printf '#include \"%s\"\\n#include \"%s\"\\n' > $@" % (include, include),
        )
        native.cc_library(
            name = name + "_" + stem,
            srcs = [src],
            deps = deps,
        )
        targets.append(":" + name + "_" + stem)
    native.filegroup(name = name, srcs = targets)

def compile_fail_test(name, src):
    """Passes only if `src` fails to compile with the text of its `// expect-error:` line."""
    native.sh_test(
        name = name,
        srcs = ["//tools/bazel:compile_fail.sh"],
        args = ["$(location %s)" % src],
        data = [src, "//:headers"],
        # A compiler run over LibTorch's headers: tens of seconds on a loaded 2-core machine.
        size = "medium",
    )

def sw_example(name, deps = [], **kwargs):
    """An example program `<name>.cpp` (./bazelw run //examples:<name>), also run as a test."""
    native.cc_binary(
        name = name,
        srcs = [name + ".cpp"],
        # The sanitizer settings (no effect on a plain build), for --config=tsan / asan runs.
        deps = ["//:stagewise", "//tests/sanitizers:defaults"] + deps,
        # Optimised even in the default (fastbuild) build: examples print speed-ups.
        copts = ["-O2"],
        **kwargs
    )
    native.sh_test(
        name = name + "_test",
        srcs = ["//tools/bazel:run_example.sh"],
        args = ["$(location :%s)" % name],
        data = [":" + name],
        size = "medium",
    )
