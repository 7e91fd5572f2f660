"""Build, cache and load the package's C kernels (one hardened loader for all of them).

``load_library(name, source_path, defines=..., cflags=...)`` compiles ``source_path`` with the
system C compiler (``$CC``, else ``cc`` / ``gcc`` / ``clang``) into a shared library and loads
it with :mod:`ctypes`. Rules (a library is code: it must never come from a place another user
can write):

* **Cache directory**: ``$HF_FP8_CACHE`` if set, else ``~/.cache/hf_fp8``, else
  ``$TMPDIR/hf_fp8-<uid>``. It is created with mode ``0700`` and used only when it is a
  directory owned by the current user with no group/other access (a looser directory we own is
  tightened to ``0700``; one owned by someone else is refused) and its parent is not writable by
  other users (unless sticky, like ``/tmp``). A refused directory gives one warning; when no
  directory is safe, :class:`NativeUnavailable` is raised and callers take their non-C path.
* **Key**: the file name holds a hash of the source text, the defines, the flags, the compiler
  and its version, the machine and :func:`cpu_features` (``-march=native`` code is only valid
  on the CPU it was built for).
* **Builds** run under an exclusive file lock (``fcntl.flock``) per library, so concurrent
  processes or ranks build once; the library is written to a temporary name and
  ``os.replace``-d into place. A cached library that fails to load is rebuilt once. On Linux
  (util-linux's ``setpriv``) the compiler processes die with the Python process that started
  them; the temporary files of killed builds are removed at the next load of that library.
* **Parts**: ``parts=({"PART": 1}, {"PART": 2})`` compiles the source once per part (its
  defines added) into object files by concurrent compiler processes, then links them into the
  one library: a large source builds in about the time of its largest part on several cores.
  A part that fails leaves no library (the error names the part); the temporary sources and
  objects are private files of this process, removed in every case.
* **Failures** are recorded per variant (per key): one failing variant never disables another.
* ``HF_FP8_DISABLE_CPU_KERNEL=1`` turns every C kernel off (:class:`NativeUnavailable`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path

from hf_fp8.utils.processes import pid_gone

try:
    import fcntl
except ImportError:  # Windows: no lock, the atomic rename still keeps files whole
    fcntl = None  # type: ignore[assignment]

BASE_CFLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",  # no FMA contraction: kernels mirror torch bit for bit
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fPIC",
    "-shared",
    "-pthread",
)
DISABLE_ENV = "HF_FP8_DISABLE_CPU_KERNEL"
COMPILE_TIMEOUT_S = 600.0  # one whole build (all parts and the link)
CACHE_ENV = "HF_FP8_CACHE"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_LOCK = threading.Lock()
_LOADED: dict[str, ctypes.CDLL] = {}
_FAILED: dict[str, str] = {}
_WARNED: set[str] = set()


class NativeUnavailable(RuntimeError):
    """A C kernel cannot be used here (no compiler, no safe cache, disabled, build failed)."""


# ------------------------------------------------------------------ CPU features
_X86_ALIASES = {  # /proc/cpuinfo spelling -> the name used in this package
    "avx512_bf16": "avx512bf16",
    "avx512_fp16": "avx512fp16",
    "avx512_vnni": "avx512vnni",
    "avx_vnni": "avxvnni",
}
_ARM_ALIASES = {"asimd": "neon", "asimdhp": "neon_fp16", "asimddp": "dotprod"}


def parse_cpu_features(cpuinfo: str, machine: str) -> frozenset[str]:
    """Feature names from the text of ``/proc/cpuinfo`` on ``machine`` (``platform.machine()``).

    x86 reads the ``flags`` line (``avx2``, ``avx512f``, ``avx512bf16``, ``amx_bf16`` …); ARM
    reads ``Features`` (``asimd`` is reported as ``neon``; ``bf16``, ``i8mm``, ``sve`` …).
    """
    arm = machine.lower().startswith(("arm", "aarch64"))
    field, aliases = ("features", _ARM_ALIASES) if arm else ("flags", _X86_ALIASES)
    raw: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == field:
            raw.update(value.split())
            break  # every core lists the same features
    out = set(raw) | {aliases[f] for f in raw if f in aliases}
    if arm and machine.lower().startswith("aarch64"):
        out.add("neon")  # Advanced SIMD is mandatory on AArch64
    return frozenset(out)


@lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """The CPU's features, e.g. ``{"avx2", "avx512f", "avx512bf16", "amx_bf16"}`` or ``{"neon"}``."""
    machine = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return parse_cpu_features(f.read(), machine)
    except OSError:
        pass
    if sys.platform == "darwin" and machine == "arm64":
        return frozenset({"neon"})
    return frozenset()


# ------------------------------------------------------------------ cache directory
def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def check_private_dir(path: Path) -> str | None:
    """Why ``path`` must not hold libraries (``None``: safe). Tightens our own dir to 0700."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"cannot stat {path}: {exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    uid = _uid()
    if uid is None:  # no POSIX ownership (Windows): user profile directories are private
        return None
    if st.st_uid != uid:
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:  # someone else may already have planted files in it: never use it
        return f"{path} is writable by group or others (mode {mode:o}); it must be 0700"
    if mode & 0o077:  # readable by others only: ours and intact, tighten it
        try:
            os.chmod(path, 0o700)
        except OSError:
            return f"{path} has mode {mode:o} and cannot be set to 0700"
    parent = Path(os.path.realpath(path)).parent
    try:
        pst = os.stat(parent)
    except OSError as exc:
        return f"cannot stat {parent}: {exc}"
    if pst.st_mode & 0o002 and not pst.st_mode & stat.S_ISVTX:
        return f"its parent {parent} is writable by every user and not sticky"
    return None


def _candidates() -> list[Path]:
    env = os.environ.get(CACHE_ENV)
    if env:
        return [Path(env).expanduser()]
    uid = _uid()
    return [
        Path.home() / ".cache" / "hf_fp8",
        Path(tempfile.gettempdir()) / f"hf_fp8-{uid if uid is not None else 0}",
    ]


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def cache_dir() -> Path:
    """The first safe cache directory (created 0700); :class:`NativeUnavailable` if none."""
    reasons = []
    candidates = _candidates()
    for path in candidates:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            reasons.append(f"cannot create {path}: {exc}")
            continue
        why = check_private_dir(path)
        if why is None:
            return path
        reasons.append(why)
        _warn_once(
            f"dir:{path}",
            f"hf_fp8: refusing the C-kernel cache {path}: {why}. Remove it or set "
            f"${CACHE_ENV} to a private directory (mode 0700)"
            + ("." if path == candidates[-1] else "; trying the next one."),
        )
    raise NativeUnavailable(
        "no safe C-kernel cache directory (" + "; ".join(reasons) + f"); set ${CACHE_ENV} "
        "to a private directory (mode 0700). The slower non-C path is used."
    )


# ------------------------------------------------------------------ building
def compiler() -> str | None:
    """Path of the C compiler: ``$CC``, else ``cc``, ``gcc`` or ``clang``."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@lru_cache(maxsize=8)
def _compiler_version(cc: str) -> str:
    try:
        proc = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"cannot run the C compiler {cc}: {exc}") from exc
    return proc.stdout + proc.stderr


def define_flags(defines: Mapping[str, object] | None) -> list[str]:
    """``-DNAME=value`` flags, sorted by name; values are ints, floats or strings."""
    flags = []
    for key in sorted(defines or {}):
        value = defines[key]  # type: ignore[index]
        if not _NAME.match(key):
            raise ValueError(f"invalid C macro name {key!r}")
        if isinstance(value, bool):
            text = str(int(value))
        elif isinstance(value, float):
            text = f"((float){value!r})"
        else:
            text = str(value)
        if "\n" in text or "\0" in text:
            raise ValueError(f"the value of C macro {key} contains a newline")
        flags.append(f"-D{key}={text}")
    return flags


def _key(source: str, flags: list[str], cc: str) -> str:
    parts = [
        source,
        "\0".join(flags),
        cc,
        _compiler_version(cc),
        platform.machine(),
        " ".join(sorted(cpu_features())),
    ]
    return hashlib.sha256("\0\0".join(parts).encode()).hexdigest()[:24]


def _check_own_file(path: Path) -> None:
    st = os.lstat(path)
    uid = _uid()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise OSError(f"{path} is not a regular file")
    if uid is not None and (st.st_uid != uid or st.st_mode & 0o022):
        raise OSError(f"{path} is not owned by this user or is writable by others")


# Runs the compiler (its arguments after the parent's pid) and kills the whole process group,
# cc1 / as / ld included, on SIGTERM: the parent-death signal setpriv sets (see _guarded).
_GUARD_SCRIPT = 'trap "kill -KILL 0" TERM; [ "$PPID" = "$1" ] || exit 125; shift; "$@" & wait $!'


@lru_cache(maxsize=1)
def _guard_prefix() -> tuple[str, ...]:
    """``setpriv --pdeathsig TERM sh -c <guard>``: the compiler's group dies with this
    process (Linux with util-linux's ``setpriv``); ``()`` elsewhere (no guard)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "killpg"):
        return ()
    setpriv, sh = shutil.which("setpriv"), shutil.which("sh")
    if setpriv is None or sh is None:
        return ()
    try:  # util-linux >= 2.33 has --pdeathsig
        ok = subprocess.run(
            [setpriv, "--pdeathsig", "TERM", sh, "-c", "exit 0"],
            capture_output=True,
            stdin=subprocess.DEVNULL,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return ()
    if ok.returncode != 0:
        return ()
    return (setpriv, "--pdeathsig", "TERM", sh, "-c", _GUARD_SCRIPT, "hf_fp8-cc")


def _guarded(cmd: list[str]) -> list[str]:
    """``cmd`` run so that it dies with this process: a SIGKILL of Python while it compiles
    left the compiler running under init, writing into the cache later (R20 F7)."""
    prefix = _guard_prefix()
    return [*prefix, str(os.getpid()), *cmd] if prefix else cmd


def _run(cmd: list[str], what: str) -> subprocess.Popen[str]:
    """Start a compiler run in a process group of its own, so that :func:`_stop` reaches the
    driver's children (gcc's cc1 / as hold the output pipes); on Linux the group is killed
    when this process dies (:func:`_guarded`)."""
    try:
        return subprocess.Popen(
            _guarded(cmd),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=hasattr(os, "killpg"),
        )
    except OSError as exc:
        raise NativeUnavailable(f"running {cmd[0]} for {what} failed: {exc}") from exc


def _stop(proc: subprocess.Popen[str]) -> None:
    """Kill a compiler run and every process of its group, then reap it."""
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except OSError:  # already gone
        pass
    try:
        proc.communicate(timeout=10)
    except subprocess.SubprocessError:  # a grandchild that left the group holds a pipe
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        proc.wait()


def _wait(proc: subprocess.Popen[str], what: str, deadline: float) -> None:
    try:
        _, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired as exc:
        _stop(proc)
        raise NativeUnavailable(f"{what} timed out after {COMPILE_TIMEOUT_S:.0f} s") from exc
    if proc.returncode != 0:
        raise NativeUnavailable(f"{what} failed:\n{err[-2000:]}")


def _compile(
    cc: str, source: str, flags: list[str], dest: Path, parts: list[list[str]] | None = None
) -> None:
    """Build ``dest`` from ``source``: one compiler run, or with ``parts`` (the extra flags of
    each part) one concurrent ``-c`` run per part and a link of their objects."""
    tmp_c = dest.with_name(f".{dest.stem}.{os.getpid()}.{threading.get_ident()}.c")
    tmp_so = tmp_c.with_suffix(".so")
    objs = [tmp_c.with_suffix(f".part{i}.o") for i in range(len(parts or ()))]
    procs: list[subprocess.Popen[str]] = []
    deadline = time.monotonic() + COMPILE_TIMEOUT_S  # for the whole build, parts and link
    try:
        tmp_c.write_text(source)
        if not parts:
            procs.append(_run([cc, *flags, str(tmp_c), "-o", str(tmp_so)], dest.name))
            _wait(procs[0], f"compiling {dest.name}", deadline)
        else:
            whats = [
                f"compiling part {i + 1} of {len(parts)} ({' '.join(p)}) of {dest.name}"
                for i, p in enumerate(parts)
            ]
            for part, obj, what in zip(parts, objs, whats, strict=True):
                procs.append(_run([cc, *flags, *part, "-c", str(tmp_c), "-o", str(obj)], what))
            for proc, what in zip(procs, whats, strict=True):
                _wait(proc, what, deadline)  # the first failure stops the others (finally)
            link = [cc, *flags, *map(str, objs), "-o", str(tmp_so)]
            procs.append(_run(link, dest.name))
            _wait(procs[-1], f"linking {dest.name}", deadline)
        os.chmod(tmp_so, 0o700)
        os.replace(tmp_so, dest)  # atomic: a reader sees the old file or the whole new one
    finally:
        for proc in procs:  # an error or timeout: no compiler outlives the build
            if proc.returncode is None:
                _stop(proc)
        for p in (tmp_c, tmp_so, *objs):
            p.unlink(missing_ok=True)


def _remove_orphans(cache: Path, stem: str) -> None:
    """Remove the temporary sources, objects and libraries of builds of ``stem`` whose process
    was killed (named ``.{stem}.{pid}.{thread}.*`` by :func:`_compile`): ours, in our cache,
    with that process gone. Called under ``stem``'s build lock."""
    pattern = re.compile(rf"\.{re.escape(stem)}\.(\d+)\.\d+\.(c|so|part\d+\.o)")
    uid = _uid()
    for entry in os.scandir(cache):
        match = pattern.fullmatch(entry.name)
        if match is None or not pid_gone(int(match[1])):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and (uid is None or st.st_uid == uid):
                os.unlink(cache / entry.name)
        except OSError:
            pass


def _open(path: Path) -> ctypes.CDLL:
    _check_own_file(path)
    return ctypes.CDLL(str(path))


def _build_and_load(
    cache: Path,
    lib_path: Path,
    cc: str,
    source: str,
    flags: list[str],
    parts: list[list[str]] | None = None,
):
    lock_path = cache / f"{lib_path.stem}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # concurrent ranks: one builds, the others wait
        # also when the library exists: a killed build's compiler may have written its
        # output after the library was built (scanned once per library and process)
        _remove_orphans(cache, lib_path.stem)
        if lib_path.exists():
            try:
                return _open(lib_path)
            except OSError:  # corrupt, truncated, foreign: rebuild once
                lib_path.unlink(missing_ok=True)
        _compile(cc, source, flags, lib_path, parts)
        try:
            return _open(lib_path)
        except OSError as exc:
            raise NativeUnavailable(f"the freshly built {lib_path} does not load: {exc}") from exc
    finally:
        os.close(fd)  # releases the lock


def load_library(
    name: str,
    source_path: str | os.PathLike[str],
    *,
    defines: Mapping[str, object] | None = None,
    cflags: Iterable[str] = (),
    parts: Sequence[Mapping[str, object]] = (),
) -> ctypes.CDLL:
    """Compile (once, cached) and load the C file ``source_path`` as library ``name``.

    ``defines`` become ``-DNAME=value`` (floats as ``((float)repr)``), ``cflags`` follow
    :data:`BASE_CFLAGS`. ``parts``: the extra defines of each part when the source is compiled
    in parts, concurrently, and linked (see the module docstring); empty: one compile. Each
    distinct (source, defines, flags, parts, compiler, CPU) is one variant,
    built at most once per machine and loaded at most once per process. Raises
    :class:`NativeUnavailable` (with the reason, remembered for this variant) when it cannot
    be built or loaded; callers then take their non-C path.
    """
    if not _NAME.match(name):
        raise ValueError(f"invalid library name {name!r}")
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        raise NativeUnavailable(f"disabled by {DISABLE_ENV}=1")
    flags = [*BASE_CFLAGS, *cflags, *define_flags(defines)]
    part_flags = [define_flags(p) for p in parts] or None
    try:
        source = Path(source_path).read_text()
    except OSError as exc:
        raise NativeUnavailable(f"cannot read the C source {source_path}: {exc}") from exc
    with _LOCK:
        cc = compiler()
        if cc is None:
            raise NativeUnavailable("no C compiler found (install gcc or clang, or set $CC)")
        key_flags = flags + [f"--part={' '.join(p)}" for p in part_flags or ()]
        key = f"{name}-{_key(source, key_flags, cc)}"
        if key in _LOADED:
            return _LOADED[key]
        if key in _FAILED:
            raise NativeUnavailable(_FAILED[key])
        try:
            cache = cache_dir()
            lib = _build_and_load(cache, cache / f"{key}.so", cc, source, flags, part_flags)
        except NativeUnavailable as exc:
            _FAILED[key] = str(exc)
            raise
        except OSError as exc:
            _FAILED[key] = f"{type(exc).__name__}: {exc}"
            raise NativeUnavailable(_FAILED[key]) from exc
        _LOADED[key] = lib
        return lib


def forget() -> None:
    """Drop this process's records of loaded and failed libraries (tests; a new ``$CC``)."""
    with _LOCK:
        _LOADED.clear()
        _FAILED.clear()
        _WARNED.clear()
