"""The shared C loader (hf_fp8.utils.native): safe cache, lock, per-variant failures, rebuilds."""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from hf_fp8.utils import native

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")

SOURCE = textwrap.dedent(
    """
    #ifdef FAIL
    #error "this variant does not build"
    #endif
    #ifndef OFFSET
    #define OFFSET 0
    #endif
    int add(int a, int b) { return a + b + OFFSET; }
    """
)
PLANTED = textwrap.dedent(
    """
    #include <stdio.h>
    __attribute__((constructor)) static void planted(void) {
        FILE* f = fopen(MARKER, "w"); if (f) { fputs("ran", f); fclose(f); }
    }
    int add(int a, int b) { return 0; }
    """
)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A private cache, a source file and a compiler wrapper that logs every build."""
    monkeypatch.delenv(native.DISABLE_ENV, raising=False)
    cache = tmp_path / "cache"
    monkeypatch.setenv(native.CACHE_ENV, str(cache))
    src = tmp_path / "add.c"
    src.write_text(SOURCE)
    log = tmp_path / "builds.log"
    real_cc = native.compiler()
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text(
        f'#!/bin/sh\ncase "$*" in *--version*) ;; *) echo build >> {log}; sleep 0.5;; esac\n'
        f'exec {real_cc} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    native.forget()
    yield {"cache": cache, "src": src, "log": log, "tmp": tmp_path}
    native.forget()


def builds(env) -> int:
    return len(env["log"].read_text().splitlines()) if env["log"].exists() else 0


def add(lib: ctypes.CDLL, a: int, b: int) -> int:
    lib.add.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.add.restype = ctypes.c_int
    return lib.add(a, b)


def expected_path(env, **kwargs) -> Path:
    flags = [*native.BASE_CFLAGS, *native.define_flags(kwargs.get("defines"))]
    key = native._key(SOURCE, flags, native.compiler())
    return env["cache"] / f"add-{key}.so"


def plant(env, target: Path) -> Path:
    """Build a library whose constructor writes a marker file, at ``target``."""
    marker = env["tmp"] / "planted-ran"
    src = env["tmp"] / "planted.c"
    src.write_text(PLANTED)
    subprocess.run(
        ["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', str(src), "-o", str(target)],
        check=True,
    )
    return marker


def test_builds_once_and_caches_with_private_mode(env):
    lib = native.load_library("add", env["src"], defines={"OFFSET": 1})
    assert add(lib, 2, 3) == 6
    assert stat.S_IMODE(os.stat(env["cache"]).st_mode) == 0o700
    native.forget()
    assert add(native.load_library("add", env["src"], defines={"OFFSET": 1}), 2, 3) == 6
    assert builds(env) == 1  # the second process-level load used the cached file


@pytest.mark.parametrize("attack", ["world_writable", "foreign_owner"])
def test_planted_library_in_unsafe_dir_is_never_loaded(env, monkeypatch, attack):
    cache = env["cache"]
    cache.mkdir()
    target = expected_path(env)
    marker = plant(env, target)
    if attack == "world_writable":
        os.chmod(cache, 0o777)
    else:  # the directory belongs to another user
        monkeypatch.setattr(native, "_uid", lambda: os.stat(cache).st_uid + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(native.NativeUnavailable, match="private directory"):
            native.load_library("add", env["src"])
        with pytest.raises(native.NativeUnavailable):  # remembered: no second warning
            native.load_library("add", env["src"])
    assert len(caught) == 1 and "refusing the C-kernel cache" in str(caught[0].message)
    assert not marker.exists(), "the planted library's constructor ran"
    assert builds(env) == 0


def test_planted_file_not_ours_in_private_dir_is_replaced(env):
    env["cache"].mkdir(mode=0o700)
    target = expected_path(env)
    marker = plant(env, target)
    os.chmod(target, 0o777)  # group/other-writable: not a file we wrote
    assert add(native.load_library("add", env["src"]), 2, 3) == 5
    assert not marker.exists()
    assert builds(env) == 1


# loads native.py alone (no torch import): a cheap second process
LOAD = (
    "import importlib.util, sys; "
    f"spec = importlib.util.spec_from_file_location('native', {native.__file__!r}); "
    "native = importlib.util.module_from_spec(spec); spec.loader.exec_module(native); "
    "lib = native.load_library('add', sys.argv[1]); print(lib.add(20, 22))"
)


def test_corrupt_cached_library_is_rebuilt(env):
    # built by another process (a library mapped here could not be replaced under our feet)
    subprocess.run([sys.executable, "-c", LOAD, str(env["src"])], check=True)
    path = expected_path(env)
    path.unlink()
    path.write_bytes(b"\x7fELF truncated garbage")
    path.chmod(0o700)
    assert add(native.load_library("add", env["src"]), 4, 5) == 9
    assert builds(env) == 2


def test_failing_variant_does_not_disable_others(env):
    with pytest.raises(native.NativeUnavailable, match="does not build"):
        native.load_library("add", env["src"], defines={"FAIL": 1})
    assert add(native.load_library("add", env["src"], defines={"OFFSET": 10}), 1, 1) == 12
    with pytest.raises(native.NativeUnavailable, match="does not build"):
        native.load_library("add", env["src"], defines={"FAIL": 1})
    assert builds(env) == 2  # the failure is remembered: no second attempt


def test_concurrent_processes_build_once(env):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LOAD, str(env["src"])], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == ["42", "42"]
    assert builds(env) == 1


def test_disable_env(env, monkeypatch):
    monkeypatch.setenv(native.DISABLE_ENV, "1")
    with pytest.raises(native.NativeUnavailable, match=native.DISABLE_ENV):
        native.load_library("add", env["src"])


def test_cache_key_depends_on_cpu_features(env, monkeypatch):
    flags = list(native.BASE_CFLAGS)
    a = native._key(SOURCE, flags, native.compiler())
    monkeypatch.setattr(native, "cpu_features", lambda: frozenset({"avx2"}))
    assert native._key(SOURCE, flags, native.compiler()) != a


X86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes bf16 i8mm sve\nCPU implementer\t: 0x41\n"


def test_cpu_features_parse_x86_and_arm():
    x86 = native.parse_cpu_features(X86, "x86_64")
    assert {"avx2", "avx512f", "avx512bf16", "amx_bf16"} <= x86
    assert "neon" not in x86
    arm = native.parse_cpu_features(ARM, "aarch64")
    assert {"neon", "bf16", "i8mm", "sve"} <= arm
    assert "avx2" not in arm
    assert native.parse_cpu_features(X86, "aarch64") == {"neon"}  # no Features line
    assert native.parse_cpu_features("", "x86_64") == frozenset()


def test_unsafe_home_cache_falls_back_to_private_tmp_dir(env, monkeypatch, tmp_path):
    monkeypatch.delenv(native.CACHE_ENV)
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    (home / ".cache" / "hf_fp8").mkdir(parents=True)
    os.chmod(home / ".cache" / "hf_fp8", 0o777)
    tmp.mkdir()
    monkeypatch.setattr(Path, "home", lambda: home)
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp))
    with pytest.warns(RuntimeWarning, match="trying the next one"):
        path = native.cache_dir()
    assert path.parent == tmp and stat.S_IMODE(os.stat(path).st_mode) == 0o700
    # the fallback is checked the same way: a planted world-writable one is refused too
    os.chmod(path, 0o777)
    native.forget()
    with pytest.warns(RuntimeWarning), pytest.raises(native.NativeUnavailable):
        native.cache_dir()


PARTS_SOURCE = textwrap.dedent(
    """
    #if PART == 1
    extern int shared_offset;
    int add(int a, int b) { return a + b + shared_offset; }
    #else
    int shared_offset = 100;
    int sub(int a, int b) { return a - b; }
    #endif
    #if defined(FAIL) && FAIL == PART
    #error "this part does not build"
    #endif
    """
)
PARTS = ({"PART": 1}, {"PART": 2})


def _parts_with_compiler(tmp_path, monkeypatch, body: str):
    """Write the two-part source and a compiler wrapper (``$CC``) running the shell ``body``
    for every call but ``--version``; return the source path."""
    src = tmp_path / "parts.c"
    src.write_text(PARTS_SOURCE)
    wrapper = tmp_path / "cc-parts"
    wrapper.write_text(
        "#!/bin/sh\n"
        'case "$*" in *--version*) exec ' + str(native.compiler()) + ' "$@";; esac\n' + body
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    native.forget()
    return src


@pytest.fixture
def parts_env(env, tmp_path, monkeypatch):
    """``env`` with a two-part source and a compiler wrapper that logs when each run starts
    and ends (the -c runs sleep 0.5 s between the two)."""
    log = tmp_path / "runs.log"
    src = _parts_with_compiler(
        tmp_path,
        monkeypatch,
        'kind=link; case "$*" in *" -c "*) kind=compile;; esac\n'
        f'echo "start $kind" >> {log}\n'
        '[ "$kind" = compile ] && sleep 0.5\n'
        f'{native.compiler()} "$@"; rc=$?\n'
        f'echo "end $kind" >> {log}\n'
        "exit $rc\n",
    )
    return {**env, "src": src, "runs": log}


def runs(env) -> list[str]:
    return env["runs"].read_text().splitlines() if env["runs"].exists() else []


def test_parts_compile_concurrently_link_into_one_cached_library(parts_env):
    lib = native.load_library("parts", parts_env["src"], parts=PARTS)
    lib.sub.argtypes = [ctypes.c_int, ctypes.c_int]
    assert add(lib, 2, 3) == 105  # part 1 reads the global that part 2 defines
    assert lib.sub(7, 2) == 5
    log = runs(parts_env)
    # both compiles start before either ends (concurrent), the link runs after both
    assert log[:2] == ["start compile", "start compile"], log
    assert log[2:] == ["end compile", "end compile", "start link", "end link"], log
    assert stat.S_IMODE(os.stat(parts_env["cache"]).st_mode) == 0o700
    # only the library and its lock remain: no temporary source or object left behind
    names = sorted(p.suffix for p in parts_env["cache"].iterdir())
    assert names == [".lock", ".so"], names
    for f in parts_env["cache"].glob("*.so"):
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o700
    native.forget()
    assert add(native.load_library("parts", parts_env["src"], parts=PARTS), 1, 1) == 102
    assert len(runs(parts_env)) == 6  # cached: no new compiler run


def test_parts_are_part_of_the_cache_key(parts_env):
    # the same source built whole (here: part 2's code alone) is another variant
    lib = native.load_library("parts", parts_env["src"], defines={"PART": 2})
    assert not hasattr(lib, "add") and lib.sub(3, 1) == 2
    assert add(native.load_library("parts", parts_env["src"], parts=PARTS), 0, 0) == 100
    assert len(list(parts_env["cache"].glob("*.so"))) == 2


@pytest.mark.parametrize("failing", [1, 2])
def test_a_failing_part_leaves_no_library_and_names_the_part(parts_env, failing):
    with pytest.raises(native.NativeUnavailable) as err:
        native.load_library("parts", parts_env["src"], defines={"FAIL": failing}, parts=PARTS)
    message = str(err.value)
    assert f"compiling part {failing} of 2 (-DPART={failing})" in message
    assert "this part does not build" in message
    assert "start link" not in runs(parts_env)  # no link of a partial build
    assert [p.suffix for p in parts_env["cache"].iterdir()] == [".lock"]  # nothing else left
    with pytest.raises(native.NativeUnavailable, match=f"part {failing} of 2"):
        native.load_library("parts", parts_env["src"], defines={"FAIL": failing}, parts=PARTS)
    assert runs(parts_env).count("start compile") == 2  # remembered: no second attempt
    # the other variants still build
    assert add(native.load_library("parts", parts_env["src"], parts=PARTS), 1, 2) == 103


@pytest.mark.parametrize("hanging", [1, 2])
def test_a_hung_compiler_and_its_children_are_stopped_at_the_timeout(
    env, tmp_path, monkeypatch, hanging
):
    """A real gcc driver's child (cc1) holds the output pipes: killing only the driver at the
    timeout left the build waiting for the child, holding the build lock (reviewer repro).
    Every process of the build is stopped at the deadline, and the other part with it."""
    child_pid = tmp_path / "child.pid"
    src = _parts_with_compiler(
        tmp_path,
        monkeypatch,
        f'case "$*" in *-DPART={hanging}*) sleep 60 & echo $! > {child_pid}; wait;; esac\n'
        f'exec {native.compiler()} "$@"\n',
    )
    monkeypatch.setattr(native, "COMPILE_TIMEOUT_S", 2.0)
    start = time.monotonic()
    with pytest.raises(native.NativeUnavailable, match="timed out"):
        native.load_library("hang", src, parts=PARTS)
    assert time.monotonic() - start < 20  # not the child's 60 s
    pid = int(child_pid.read_text())
    for _ in range(50):  # the killed child is reaped by init: poll until it is gone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the compiler's child process outlived the build")
    names = sorted(p.suffix for p in env["cache"].iterdir())
    assert ".so" not in names and ".c" not in names and ".o" not in names, names


def test_a_later_build_removes_what_a_killed_build_left(env, tmp_path):
    """A build killed by SIGKILL leaves its temporary source and objects in the cache: the
    next build of that library removes those of dead processes, never a running one's."""
    src = tmp_path / "parts.c"
    src.write_text(PARTS_SOURCE)
    native.load_library("orphans", src, parts=PARTS)  # find the library's file name
    stem = next(env["cache"].glob("*.so")).stem
    for p in env["cache"].glob("*.so"):
        p.unlink()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = [env["cache"] / f".{stem}.{dead.pid}.7.{s}" for s in ("c", "part0.o", "so")]
    running = env["cache"] / f".{stem}.{os.getpid()}.7.c"
    other = env["cache"] / f".otherlib.{dead.pid}.7.c"
    for p in (*left, running, other):
        p.write_text("x")
    native.forget()
    native.load_library("orphans", src, parts=PARTS)
    assert not any(p.exists() for p in left)
    assert running.exists() and other.exists()  # a live process's; another library's
