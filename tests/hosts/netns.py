"""Several hosts on one machine: network namespaces joined by a bridge (issue 42).

Each host is a network namespace with its own interface `eth0` (address 10.77.0.<i+1>/24,
a veth pair to a bridge in a switch namespace) and loopback; commands run in it under
their own UTS namespace, so they see the host name `host<i>`, which resolves to nothing
(as in containers). As far as the kernel's network stack is concerned these are separate
hosts: traffic between them crosses the veth pairs and the bridge, where it can be
shaped (a rate with tc `tbf`, loss with nftables, a delay with `linkdelay`, a forwarder
of our own: this kernel has no `tc netem`) and cut.

    with Hosts(2) as hosts:           # skips nothing: raises Unavailable with the reason
        p = hosts.popen(0, ["smprun", ...], env=...)
        hosts.shape(1, delay_ms=20)   # host 1's link: +20 ms each way, +40 ms a round trip
        hosts.cut(1); hosts.restore(1)

Everything is removed on exit, on an exception and on SIGINT/SIGTERM (the namespaces,
and with them the links; the processes started in them are killed first).

As a script, for a user:  python tests/hosts/netns.py N -- COMMAND...  runs COMMAND in
each of N hosts with HOST_INDEX, HOST_ADDR, MASTER_ADDR (host 0's address) and
GLOO_SOCKET_IFNAME=eth0 set, and waits for all of them.
"""
import atexit
import os
import select
import shlex
import signal
import subprocess
import sys

__all__ = ["Hosts", "Unavailable"]

SUBNET = "10.77.0"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Unavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2, a restricted container)."""


def _ip(*args, check=True):
    out = subprocess.run(["ip", *map(str, args)], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(map(str, args))}: {out.stderr.strip()}")
    return out


def available():
    """(True, "") where namespaces can be made, else (False, the one-line reason)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root (this process is not)"
    probe = f"smpprobe{os.getpid()}"
    try:
        out = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return False, "iproute2's `ip` is not installed"
    if out.returncode != 0:
        return False, f"cannot make a network namespace: {out.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


class Hosts:
    def __init__(self, n):
        ok, why = available()
        if not ok:
            raise Unavailable(why)
        self.n = n
        tag = f"smp{os.getpid() % 100000}"
        self.switch = f"{tag}sw"
        self.names = [f"{tag}h{i}" for i in range(n)]
        self.procs = []
        self._delays = {}  # host index -> its link's linkdelay process
        self._up = False

    # --- the network ------------------------------------------------------------------
    def addr(self, i):
        return f"{SUBNET}.{i + 1}"

    def _port(self, i):  # the switch's end of host i's link (names <= 15 characters)
        return f"s{os.getpid() % 100000}p{i}"

    def up(self):
        self._up = True
        atexit.register(self.down)
        self._old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            host_end, sw_end = f"h{os.getpid() % 100000}p{i}", self._port(i)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", sw_end)
            _ip("link", "set", host_end, "netns", ns)
            _ip("link", "set", sw_end, "netns", self.switch)
            _ip("-n", ns, "link", "set", host_end, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "set", sw_end, "master", "br0")
            _ip("-n", self.switch, "link", "set", sw_end, "up")
        return self

    def shape(self, i, delay_ms=None, rate_mbit=None, loss_pct=None):
        """Shapes host i's link; None leaves that property as it is, shape() again
        replaces it. A rate with tc `tbf` and loss with an nftables rule dropping that
        share of the packets each end sends (`numgen random`), on both ends (host i's
        eth0 and the switch's port). A delay: every frame crossing the link, in either
        direction, arrives `delay_ms` (a float; 0 removes it) later than it would, so
        host i's round trip to any other host gains 2 * delay_ms (4 * delay_ms between
        two hosts delayed so). This kernel has no `tc netem`, so the switch's port is
        taken off the bridge and joined to it through `linkdelay` (tests/hosts/
        linkdelay.cpp, built into $SMP_BUILD_DIR/tests), which holds each frame in a
        FIFO per direction (order kept; beyond 32 MiB waiting it drops, as a router
        does). Raises Unavailable where a shaping cannot be had here, naming why."""
        if delay_ms is not None:
            self._delay(i, delay_ms)
        ends = ((self.names[i], "eth0"), (self.switch, self._port(i)))
        if rate_mbit:
            for ns, dev in ends:
                out = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev",
                                      dev, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst",
                                      "64kb", "latency", "400ms"], capture_output=True, text=True)
                if out.returncode != 0:
                    raise Unavailable(f"tc tbf is not available here ({out.stderr.strip()}): "
                                      "links cannot be rate-limited")
        if loss_pct is not None:
            per_mille = int(round(loss_pct * 10))
            for ns, dev in ends:
                # A table of its own per end, replaced whole: shape() again changes the loss.
                rules = (f"table netdev smp_loss\ndelete table netdev smp_loss\n"
                         f"table netdev smp_loss {{\n chain out {{\n"
                         f"  type filter hook egress device {dev} priority 0;\n"
                         f"  numgen random mod 1000 < {per_mille} drop\n }}\n}}\n")
                try:
                    out = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"],
                                         input=rules, capture_output=True, text=True)
                except FileNotFoundError:
                    raise Unavailable("nft (Debian's nftables) is not installed: links cannot "
                                      "be made lossy") from None
                if out.returncode != 0:
                    raise Unavailable(f"nftables cannot drop packets here "
                                      f"({out.stderr.strip()}): links cannot be made lossy")

    def _delay_ends(self, i):  # linkdelay's end of the veth to the bridge, the bridge's
        return f"s{os.getpid() % 100000}d{i}", f"s{os.getpid() % 100000}b{i}"

    def _delay(self, i, delay_ms):
        self._stop_delay(i)
        fwd, bridged = self._delay_ends(i)
        if not delay_ms:
            if _ip("-n", self.switch, "link", "show", fwd, check=False).returncode == 0:
                _ip("-n", self.switch, "link", "del", fwd)  # its peer goes with it
                _ip("-n", self.switch, "link", "set", self._port(i), "master", "br0")
            return
        build = os.path.abspath(os.environ.get("SMP_BUILD_DIR", os.path.join(REPO, "build")))
        binary = os.path.join(build, "tests", "linkdelay")
        if not os.access(binary, os.X_OK):
            raise Unavailable(f"{binary} is not built (cmake --build {build} --target "
                              "linkdelay): links cannot be given a delay")
        if _ip("-n", self.switch, "link", "show", fwd, check=False).returncode != 0:
            _ip("-n", self.switch, "link", "add", fwd, "type", "veth", "peer", "name", bridged)
            _ip("-n", self.switch, "link", "set", self._port(i), "nomaster")
            _ip("-n", self.switch, "link", "set", bridged, "master", "br0")
            for dev in (bridged, fwd):
                _ip("-n", self.switch, "link", "set", dev, "up")
        p = subprocess.Popen(["ip", "netns", "exec", self.switch, binary, self._port(i), fwd,
                              str(int(round(delay_ms * 1000)))], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
        self._delays[i] = p
        line = p.stdout.readline().strip() if select.select([p.stdout], [], [], 10)[0] else ""
        if line != "ready":
            self._stop_delay(i)
            raise RuntimeError(f"linkdelay for host {i}'s link did not start: "
                               f"{line or 'no answer in 10 s'}")

    def _stop_delay(self, i):
        p = self._delays.pop(i, None)
        if p is not None:
            p.kill()  # it holds nothing that needs cleaning up
            p.wait()
            p.stdout.close()

    def cut(self, i):
        # Where linkdelay is in the path its end goes down too: frames it holds are lost.
        for dev in self._link_devs(i):
            _ip("-n", self.switch, "link", "set", dev, "down")

    def restore(self, i):
        for dev in self._link_devs(i):
            _ip("-n", self.switch, "link", "set", dev, "up")

    def _link_devs(self, i):
        return [self._port(i)] + ([self._delay_ends(i)[0]] if i in self._delays else [])

    # --- processes --------------------------------------------------------------------
    def command(self, i, argv):
        """`argv` run in host i: its network namespace, its own host name."""
        inner = f"hostname host{i} && exec {' '.join(shlex.quote(str(a)) for a in argv)}"
        return ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c", inner]

    def popen(self, i, argv, **kw):
        p = subprocess.Popen(self.command(i, argv), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def kill(self, i=None):
        """SIGKILLs every process in host i (every host by default): what was started
        there, and whatever it started in sessions of its own (torchrun's ranks), found
        by the namespace (`ip netns pids`). A host that dies loses them all."""
        for p in self.procs:
            if p.poll() is None and (i is None or p.args[3] == self.names[i]):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in self.names if i is None else [self.names[i]]:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in out.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass

    # --- teardown ---------------------------------------------------------------------
    def down(self):
        if not self._up:
            return
        self._up = False
        self.kill()
        for i in list(self._delays):
            self._stop_delay(i)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.names + [self.switch]:
            _ip("netns", "del", ns, check=False)
        for s, h in getattr(self, "_old", {}).items():
            signal.signal(s, h)

    def _on_signal(self, signum, frame):
        self.down()
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()
        return False


def main(argv):
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__.split("As a script")[1].strip(), file=sys.stderr)
        return 2
    n, cmd = int(argv[0]), argv[2:]
    try:
        hosts = Hosts(n)
    except Unavailable as e:
        print(f"netns.py: {e}", file=sys.stderr)
        return 2
    with hosts:
        procs = []
        for i in range(n):
            env = dict(os.environ, HOST_INDEX=str(i), HOST_ADDR=hosts.addr(i),
                       MASTER_ADDR=hosts.addr(0), GLOO_SOCKET_IFNAME="eth0")
            procs.append(hosts.popen(i, cmd, env=env))
        return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
