"""Build helpers for stagewise: doctest targets (one binary per test folder), must-not-compile tests."""

# LibTorch's headers precompiled (//tools/bazel:torch_pch): the prefix a compile-only check includes
# first, and the two files its test needs at run time.
TORCH_PREFIX = "//tools/bazel:torch_pch/torch_prefix.hpp"
TORCH_PCH = [TORCH_PREFIX, TORCH_PREFIX + ".gch"]

def unity_source(name, srcs, dispatch = False):
    """`<name>.cpp`: the sources as one translation unit (tools/unity_source; --dispatch adds a main
    that runs the program its first argument names)."""
    native.genrule(
        name = name,
        srcs = srcs,
        outs = [name + ".cpp"],
        cmd = "$(location //tools:unity_source) %s$@ $(SRCS)" % ("--dispatch " if dispatch else ""),
        tools = ["//tools:unity_source"],
    )

def syntax_check_test(name, mode, files, data, **kwargs):
    """A test that syntax-checks `files` on the precompiled LibTorch prefix (tools/bazel/
    syntax_check.py; mode "headers": each alone, included twice; "sources": each as it is)."""
    native.sh_test(
        name = name,
        srcs = ["//tools/bazel:syntax_check.py"],
        args = [mode, "--pch", "$(location %s)" % TORCH_PREFIX] + files,
        data = data + TORCH_PCH,
        **kwargs
    )

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

def sw_test_folder(name, deps = [], size = "medium", shard_count = None, **kwargs):
    """Every `*_test.cpp` of the package as one test binary `name`, compiled as one translation unit.

    tools/unity_source writes the unit: each source whole, in a namespace of its own, after the
    includes they all share. LibTorch's headers are then parsed once per folder, and the library code
    the tests share is instantiated once (a folder of 13 tests compiles in about the time of two).
    Each source also gets a target of its own, `<stem>` (tagged manual: `bazel test //...` skips it),
    for working on one file; `--test_arg=--source-file=*stem*` runs one file's cases in the folder's.
    `shard_count`: Bazel runs the binary in that many shards, each a share of the test cases
    (tests/doctest_main.cpp).
    """
    srcs = native.glob(["*_test.cpp"])
    hdrs = native.glob(["*.hpp"])
    unity_source(name = name + "_unity", srcs = srcs)
    sw_test(
        name = name,
        srcs = [name + "_unity.cpp"] + hdrs,
        deps = deps,
        size = size,
        shard_count = shard_count,
        **kwargs
    )
    for src in srcs:
        sw_test(
            name = src[:-len(".cpp")],
            srcs = [src] + hdrs,
            deps = deps,
            size = size,
            tags = ["manual"],
            **kwargs
        )

def compile_fail_test(name, src):
    """Passes only if `src` fails to compile with the text of its `// expect-error:` line."""
    native.sh_test(
        name = name,
        srcs = ["//tools/bazel:compile_fail.sh"],
        args = ["$(location %s)" % src, "$(location %s)" % TORCH_PREFIX],
        data = [src, "//:headers"] + TORCH_PCH,
        # A compiler run over stagewise's headers, LibTorch's precompiled (//tools/bazel:torch_pch).
        size = "medium",
    )

def sw_example(name, deps = [], copts = ["-O2"], **kwargs):
    """An example program `<name>.cpp`: ./bazelw run //examples:<name> builds and runs it alone.

    Optimised even in the default (fastbuild) build: examples print speed-ups. Its test is one of
    sw_examples_test's (the examples built as one program)."""
    native.cc_binary(
        name = name,
        srcs = [name + ".cpp"],
        # The sanitizer settings (no effect on a plain build), for --config=tsan / asan runs.
        deps = ["//:stagewise", "//tests/sanitizers:defaults"] + deps,
        copts = copts,
        **kwargs
    )

def sw_examples_test(name, programs, deps = [], args = {}):
    """Every example as one program `name`, and a test `<example>_test` running each.

    tools/unity_source --dispatch writes the examples as one translation unit, each in its own
    namespace, with a main that runs the example its first argument names (`name quickstart`):
    compiled once (the library code they share instantiated once) instead of once per example.
    `programs`: example name -> ranks (0: run as a plain program; N: N ranks through tools/launch).
    `args`: example name -> extra arguments its test passes (e.g. a short run's flags).
    """
    names = sorted(programs.keys())
    unity_source(name = name + "_unity", srcs = [n + ".cpp" for n in names], dispatch = True)
    native.cc_binary(
        name = name,
        srcs = [name + "_unity.cpp"],
        deps = ["//:stagewise", "//tests/sanitizers:defaults"] + deps,
        copts = ["-O2"],
    )
    for n in names:
        ranks = programs[n]
        if ranks:
            native.sh_test(
                name = n + "_test",
                size = "medium",
                srcs = ["//tools/bazel:run_launched.sh"],
                args = ["$(location //tools:launch)", str(ranks), "$(location :%s)" % name, n] + args.get(n, []),
                data = [":" + name, "//tools:launch"],
            )
        else:
            native.sh_test(
                name = n + "_test",
                size = "medium",
                srcs = ["//tools/bazel:run_example.sh"],
                args = ["$(location :%s)" % name, n] + args.get(n, []),
                data = [":" + name],
            )
