"""The ``python_sandbox`` tool: model-written Python in a contained, throwaway process.

Each call runs in its own process, forked for it and discarded afterwards, so hostile code can
never poison the next call. The process is contained by the strongest mechanisms the host allows,
probed once at start (``PythonSandbox.isolation`` says which are in force):

* ``netns`` / ``pidns``: private network (no route out, not even 127.0.0.1) and PID namespaces,
  fresh for each call; when the call's process ends the kernel kills everything it spawned, and
  no host process is visible.
* ``ipcns`` / ``utsns`` / ``cgroupns``: SysV shared memory, message queues and semaphores and
  POSIX message queues (its own ``/dev/mqueue``) are the call's and vanish with it; its
  hostname is ``sandbox``; ``/proc/self/cgroup`` shows its own cgroups as the root.
* ``owned-namespaces``: a user namespace of the call's is made first and owns all of these
  (its ids mapped to themselves by the zygote), so what the kernel broadcasts to namespaces
  of the initial user namespace (uevents to network namespaces) never reaches a call.
* ``tmpfs-workdir``: the working directory is a tmpfs of ``max_disk_mb`` in the call's mount
  namespace: writes past it fail (ENOSPC) and it goes with the namespace, with nothing for the
  host to remove.
* ``uid``: the code runs as an unprivileged uid of its own (``uid_base + n``), which no other
  worker on the host holds at the same time (a lock file per uid, ``flock``-ed for the
  worker's life), so it cannot write root's files, read other processes' environments or
  signal other sandboxes, and ``RLIMIT_NPROC`` binds (it does not bind root). ``keyrings``: it
  joins a fresh session keyring and its uid's user keyring is emptied first.
* ``userns``: it then enters a user namespace of its own (its uid mapped to itself, no
  capabilities) in which no further user namespace can be made; the user and persistent
  keyrings it sees are that namespace's and die with it. Where the host refuses one, the
  uid's persistent keyring is shared by calls of that uid (logged as a warning).
* ``private-root``: the code sees a root of its own (a tmpfs entered with ``pivot_root``, the
  host's tree detached): the interpreter, its standard library (without site-packages) and
  ``libpython``, the ``allowed_packages`` (default: none beyond the standard library) and
  only the shared libraries these load (their ELF dependencies, found with ``ldd`` once per
  process and staged once per pool by the zygote, so a call binds a directory of them, not
  each file), all read-only; a few device nodes; its working directory; private, empty ``/tmp``,
  ``/var/tmp`` and ``/dev/shm``; ``/proc`` of its PID namespace. Nothing else of the host
  (datasets, checkouts, configuration, other users' temporary files) exists for it, and
  nothing it writes outside its directory outlives the call. No shell (``/bin/sh``) is there:
  subprocesses run ``sys.executable``, the interpreter's real path. Nothing of the host's
  identity is in it: the call works in ``/home/sandbox`` (its ``HOME``; ``TMPDIR`` is its
  ``/tmp``), the allowed packages are bound under ``root.SITE``, and the zygote's
  configuration arrives on its stdin, not in the argv every call inherits.
* ``mountns`` (the fallback where a private root cannot be made): when the interpreter lives
  under a directory the unprivileged uid cannot search (e.g. ``/root/.pyenv``), that directory
  is covered by an empty tmpfs in a private mount namespace and only the interpreter's prefixes
  are bound back in; the host's world-readable files stay readable (logged as a warning).
* ``cgroup-pids`` / ``cgroup-memory`` / ``cgroup-cpu`` / ``cgroup-cpuacct``: a cgroup per
  worker bounds the process count and the memory of the whole tree, how many cores it may use
  at once (``cpu_cores``, a CFS quota) and, from its CPU accounting, the CPU-seconds of the
  whole call (``cpu_seconds``: read while it runs, once the budget could be spent at that rate,
  and the tree killed when it is; detached processes, each a session of its own, included),
  and it lets the tree be killed completely: in a delegated cgroup v2 subtree (``cgroup-v2``,
  the default of current distributions, whose ``cpu`` controller both bounds and accounts) or
  under the cgroup v1 controllers (``cgroup-cpu,cpuacct`` where the two are mounted together).
  A controller the host does not let this process use is left out. Groups a killed sandbox
  left behind are removed at the next start.
* ``rlimits`` (always): CPU seconds of each process (a second layer under the call's budget,
  the only one where no cgroup accounts CPU), address space, file size, process count; plus a
  wall-clock timeout that kills the process group, a fresh working directory, an environment
  without the parent's variables, and ``no-new-privs`` so setuid binaries cannot regain
  privileges.
* ``seccomp``: a system-call filter (:mod:`.seccomp`), installed after the call's setup,
  refuses with ``EPERM`` what would observe or reach outside the call (``perf_event_open``,
  ``bpf``, ``userfaultfd``, ``io_uring``, inotify and fanotify on the bound host files,
  ``ptrace``), sockets other than ``AF_UNIX`` (no vsock, uevent or IP socket), mounts, new
  namespaces, modules, clocks and ``TIOCSTI``, whatever the host's sysctls allow.

Every call's process is forked from a zygote, one per pool, that has the interpreter and the
standard modules calls commonly import loaded; the fork then takes what must be its own: a
session, its cgroups, a user namespace and, owned by it, fresh network, mount, PID, IPC, UTS and
cgroup namespaces (it forks again
to be the PID namespace's first process, so the kernel kills everything it spawns when it ends),
its private root with an empty ``/tmp``, its uid (and a nested user namespace), limits,
working directory, an empty environment and, last, the system-call filter. A child whose zygote dies dies with it; a zygote that exits
or answers unexpectedly is replaced.
Workers are forked ahead (``pool_size``) up to the point where they wait for code on stdin, so
a call costs handing over the code, running it and the interpreter's exit.

The parts: ``pool`` (``PythonSandbox``: its workers forked ahead, its calls and the isolation
it probes), ``zygote`` (the process calls are forked from), ``worker`` (a worker's directory,
cgroups, process tree and output on the host), ``plan`` (which of the mechanisms above a pool
uses), ``root`` (the private root and the shared libraries it holds), ``identity`` (uid
leases), ``cgroups``, ``seccomp`` (the system-call filter), ``protocol`` (the zygote's program
and a call's config and output) and ``limits``.
"""

from nemo_orch.tools.sandbox.cgroups import V2
from nemo_orch.tools.sandbox.limits import SandboxLimits
from nemo_orch.tools.sandbox.plan import ISOLATION_MODES
from nemo_orch.tools.sandbox.pool import SANDBOX_USD_PER_SECOND, PythonSandbox, default_spec
from nemo_orch.tools.sandbox.root import PrivateRoot

__all__ = [
    "ISOLATION_MODES",
    "SANDBOX_USD_PER_SECOND",
    "V2",
    "PrivateRoot",
    "PythonSandbox",
    "SandboxLimits",
    "default_spec",
]
