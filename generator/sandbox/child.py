"""The two programs of the code sandbox, standard library only: the launcher and the runner.

``python -I -S child.py launch CONFIG`` is the trusted launcher. It builds the sandbox (see
:func:`launch`) and then replaces the sandboxed process with ``python -I -S -c <this file> run``, the runner.

The runner executes the untrusted solution and test set-up statements and reports, one JSON line per
expression on its own copy of stdout, the VALUES of the expressions the parent asked for. It never sees the
expected values and never decides whether a test passed: the parent does that (generator/sandbox/verdict.py).
Anything the solution does to this process (monkeypatching, forged lines, ``os._exit``) can therefore only
remove or garble values, which the parent scores as failures.
"""

from __future__ import annotations

import json
import os
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
SECURE_ALL_BITS_LOCKED = 0xEF          # NOROOT, NO_SETUID_FIXUP, NO_CAP_AMBIENT_RAISE (+ locks), KEEP_CAPS off
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
NOBODY = 65534
SETUP_FAILED = 111                     # launcher exit status when the sandbox could not be built


class _Libc:
    """The few libc calls Python's ``os`` lacks (unshare, mount, pivot_root, prctl), errors as OSError."""

    def __init__(self) -> None:
        import ctypes

        self.ctypes = ctypes
        self.lib = ctypes.CDLL(None, use_errno=True)

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            errno = self.ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    def unshare(self, flags: int) -> None:
        self._check(self.lib.unshare(flags), "unshare")

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None):
        args = [s.encode() if s is not None else None for s in (source, target, fstype)]
        self._check(self.lib.mount(*args, self.ctypes.c_ulong(flags), data.encode() if data else None),
                    f"mount {source} on {target}")

    def umount(self, target: str) -> None:
        self._check(self.lib.umount2(target.encode(), MNT_DETACH), f"umount {target}")

    def pivot_root(self, new_root: str, put_old: str) -> None:
        number = PIVOT_ROOT.get(os.uname().machine)
        if number is None:
            raise OSError(f"pivot_root: unknown syscall number on {os.uname().machine}")
        self._check(self.lib.syscall(number, new_root.encode(), put_old.encode()), "pivot_root")

    def prctl(self, option: int, value: int) -> None:
        self._check(self.lib.prctl(option, self.ctypes.c_ulong(value), 0, 0, 0), f"prctl({option})")


def _locked_flags(path: str) -> int:
    """Mount flags a read-only remount must keep (the kernel refuses to clear nosuid/nodev/... of a mount)."""
    flags = os.statvfs(path).f_flag
    return sum(ms for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                                 (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME)) if flags & st)


def _bind_readonly(libc: _Libc, root: str, path: str) -> None:
    """Show host ``path`` (a directory or file) at the same place under ``root``, read-only; symlinks are copied."""
    target = root + path
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(path):
        os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "a").close()
    libc.mount(path, target, None, MS_BIND)
    libc.mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | _locked_flags(path))


def _build_root(libc: _Libc, config: dict) -> None:
    """A fresh tmpfs root holding read-only binds of the Python installation and shared libraries, a writable
    size-capped tmpfs at /sandbox, and nothing else (no /etc/passwd, /proc, /home, /tmp, /work...);
    then pivot into it and detach the host's file system."""
    root = config["root"]
    libc.mount(None, "/", None, MS_REC | MS_PRIVATE)
    libc.mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for path in config["binds"]:
        if os.path.lexists(path):
            _bind_readonly(libc, root, path)
    os.makedirs(root + "/sandbox")
    libc.mount("tmpfs", root + "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV,
               f"size={config['work_mb']}m,nr_inodes=4096,mode=0777")
    os.makedirs(root + "/.old")
    os.chdir(root)
    libc.pivot_root(".", ".old")
    os.chdir("/")
    libc.umount("/.old")
    os.rmdir("/.old")
    libc.mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _drop_privileges(libc: _Libc, config: dict) -> None:
    """No way back to any privilege: uid/gid nobody when we are root, else (in our own user namespace) an
    empty capability bounding set with root's exec-time capabilities disabled; no_new_privs in every case."""
    if config["as_nobody"]:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    elif config["userns"]:
        cap = 0
        while cap < 64:
            try:
                libc.prctl(PR_CAPBSET_DROP, cap)
            except OSError:
                break
            cap += 1
        libc.prctl(PR_SET_SECUREBITS, SECURE_ALL_BITS_LOCKED)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1)


def _set_limits(resource, limits: dict, nproc: bool) -> None:
    """Address space, CPU seconds, file size, no core dumps, and (where it is enforced) a process count."""
    pairs = [(resource.RLIMIT_AS, limits["memory"]), (resource.RLIMIT_CPU, limits["cpu"]),
             (resource.RLIMIT_FSIZE, limits["fsize"]), (resource.RLIMIT_CORE, 0)]
    if nproc:
        pairs.append((resource.RLIMIT_NPROC, 64))
    for which, value in pairs:
        resource.setrlimit(which, (value, value))


def _exec_runner(config: dict) -> None:
    """Replace this process with the runner, a fresh isolated interpreter (this file's source via ``-c``)."""
    env = {"PATH": "/nonexistent", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "TMPDIR": config["cwd"],
           "HOME": config["cwd"]}
    os.chdir(config["cwd"])
    os.execve(config["python"], [config["python"], "-I", "-S", "-c", config["source"], "run"], env)


def _sandboxed_child(libc: _Libc, config: dict, alive_r: int) -> None:
    """In the forked child (pid 1 of the new pid namespace when there is one): build the root, drop
    privileges, die with the launcher, exec the runner. Any failure exits with SETUP_FAILED, never runs code."""
    import resource  # imported while the interpreter's files are still readable (uid nobody)
    import select

    try:
        if config["mount"]:
            _build_root(libc, config)
        os.setsid()                     # its own session: kill(0, ...) reaches only the sandbox
        _drop_privileges(libc, config)
        libc.prctl(PR_SET_PDEATHSIG, 9)
        if select.select([alive_r], [], [], 0)[0]:   # the launcher already died: EOF on its pipe
            os._exit(SETUP_FAILED)
        os.close(alive_r)
        _set_limits(resource, config["limits"], nproc=config["as_nobody"] or config["userns"])
        _exec_runner(config)
    except BaseException as exc:  # noqa: BLE001 - reported and turned into the setup-failure status
        sys.stderr.write(f"sandbox setup failed: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
    os._exit(SETUP_FAILED)


def _enter_namespaces(libc: _Libc, config: dict) -> None:
    """New mount, pid, network, IPC and UTS namespaces (plus a user namespace when we are not root)."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if config["userns"]:
        uid, gid = os.geteuid(), os.getegid()
        libc.unshare(flags | CLONE_NEWUSER)
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as fh:
                fh.write(text)
    else:
        libc.unshare(flags)


def launch(config: dict) -> None:
    """The trusted launcher: die with the reward's thread, enter the namespaces, fork the sandboxed child,
    wait for it and exit with its status (128 + signal when killed)."""
    libc = _Libc()
    with open(__file__) as fh:
        config["source"] = fh.read()       # the runner's code, read before the host file system goes away
    try:
        libc.prctl(PR_SET_PDEATHSIG, 9)
        if os.getppid() != config["parent_pid"]:
            os._exit(SETUP_FAILED)
        if config["namespaces"]:
            _enter_namespaces(libc, config)
    except OSError as exc:
        sys.stderr.write(f"sandbox setup failed: {exc}\n")
        os._exit(SETUP_FAILED)
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        _sandboxed_child(libc, config, alive_r)
    os.close(alive_r)
    os.close(0)
    os.close(1)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


# --------------------------------------------------------------------------------------------------------------
# The runner: runs inside the sandbox, as untrusted as the code it runs.

_DENIED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.kill", "os.killpg",
           "pty.", "ctypes.dlopen", "signal.pthread_kill")


def _deny(event: str, args: tuple) -> None:
    """Last layer only (in-process hooks can be bypassed): refuse sockets, processes, signals, ctypes."""
    if event.startswith(_DENIED):
        raise PermissionError(f"sandbox: {event} is not allowed")


def encode(value: object, depth: int = 0) -> object:
    """``value`` as JSON, exact built-in types only (a subclass or any other object raises TypeError, so an
    object with a forged ``__eq__`` can never reach the parent); containers tagged so tuple != list."""
    if depth > 100:
        raise ValueError("value nested deeper than 100")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    if kind in (list, tuple, set, frozenset):
        return {kind.__name__: [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(value)]}
    raise TypeError(f"a {kind.__module__}.{kind.__qualname__} cannot be compared (plain data only)")


def _emit(channel, message: dict) -> None:
    """One JSON line on the private result channel; a value that cannot be encoded becomes an error line."""
    try:
        line = json.dumps(message)
    except (TypeError, ValueError, RecursionError) as exc:
        line = json.dumps({k: v for k, v in message.items() if k != "v"} | {"err": f"unencodable: {exc}"[:300]})
    channel.write(line + "\n")
    channel.flush()


def _evaluate(channel, leaf: int, source: str, env: dict) -> None:
    """Evaluate one expression the parent asked for and report its value or its exception."""
    try:
        value = eval(compile(source, "<test>", "eval"), env)
        message = {"leaf": leaf, "v": encode(value)}
    except BaseException as exc:  # noqa: BLE001 - any failure (SystemExit included) is this leaf's failure
        message = {"leaf": leaf, "err": f"{type(exc).__name__}: {exc}"[:300]}
    _emit(channel, message)


def run() -> None:
    """Phase 0: expressions that need no solution, evaluated before it exists. Phase 1: the solution, then
    each test's statements in order, reporting the value of every expression the parent asked for."""
    import builtins

    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                                   # the solution's prints go to stderr, never to the channel
    stdin = sys.stdin.buffer
    pristine = dict(builtins.__dict__)
    for leaf, source in json.loads(stdin.readline())["pure"]:
        _evaluate(channel, leaf, source, {"__builtins__": dict(pristine)})
    spec = json.loads(stdin.readline())
    sys.addaudithook(_deny)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(spec.pop("code"), "<solution>", "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001 - reported; the parent scores every test 0
        _emit(channel, {"solution_error": f"{type(exc).__name__}: {exc}"[:300]})
        return
    for index, steps in enumerate(spec.pop("tests")):
        env = dict(namespace, __builtins__=dict(pristine))
        for step in steps:
            if step[0] == "eval":
                _evaluate(channel, step[1], step[2], env)
                continue
            try:
                exec(compile(step[1], "<test>", "exec"), env)
            except BaseException as exc:  # noqa: BLE001 - this test fails, the others still run
                _emit(channel, {"test": index, "err": f"{type(exc).__name__}: {exc}"[:300]})
                break


if __name__ == "__main__":
    if sys.argv[1:2] == ["launch"]:
        launch(json.loads(sys.argv[2]))
    elif sys.argv[1:2] == ["run"]:
        run()
