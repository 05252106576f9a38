"""Mininet backend: Mininet's Python API builds the regions, the router and the links.

Theory of operation
-------------------
Run by :func:`emulation.network.build_network` (``backend="mininet"``) under the system Python
(``/usr/bin/python3``: the apt package ``mininet`` installs its modules there only), with a
JSON spec of the hosts, the router host and the interface names and addresses. It builds a
Mininet with no controller and no switch: each region host joined to the router by a veth pair,
created inside the hosts' namespaces (:func:`main`). The builder then names each node's
namespace and shapes Mininet's interfaces exactly as in the netns backend; ``TCLink`` is not
used, since it fails silently where this project must not (:func:`main`). The probe at the
start verifies what took effect. Standalone: imports only the standard library and Mininet."""

import json
import sys


def main() -> int:
    """It builds a :class:`mininet.net.Mininet` with no controller and no switch: each region host
    is joined to the router host by a direct :class:`mininet.link.Link` (a veth pair; Mininet
    creates it from inside the hosts' namespaces, so nothing appears in the host's own), the
    router forwards IPv4, and every host routes through it. It prints one line ``AUREM {"pids":
    {node: pid}}`` and then waits; on ``stop`` or end of file on stdin it stops the network and
    exits.

    The builder then names each node's namespace (``ip netns attach aurem-<tag>-<name> <pid>``)
    and shapes Mininet's interfaces exactly as in the netns backend (htb classes, bfifo queues,
    the NFQUEUE delay line or netem, iptables loss): ``TCLink`` is not used because it cannot
    give a region reached by several links one rate per link (it shapes a whole interface), it
    silently ignores rates above 1000 Mbit/s (``TCIntf.bwParamMax``), and on a kernel without
    netem its ``delay``/``loss`` print "Error: Specified qdisc kind is unknown." and carry on
    unshaped -- the silent failure this project must not repeat."""
    from mininet.link import Link
    from mininet.log import setLogLevel
    from mininet.net import Mininet
    from mininet.node import Host

    class Router(Host):
        """A host that forwards IPv4 (the hub of the star)."""

        def config(self, **params):  # noqa: ANN001, ANN201
            result = super().config(**params)
            self.cmd("sysctl -qw net.ipv4.ip_forward=1")
            return result

    spec = json.loads(sys.argv[1])
    setLogLevel("warning")
    net = Mininet(
        topo=None,
        build=False,
        controller=None,
        autoSetMacs=False,
        autoStaticArp=False,
        waitConnected=False,
    )
    router = net.addHost(spec["router"]["name"], cls=Router, ip=None)
    hosts = []
    for h in spec["hosts"]:
        host = net.addHost(h["name"], ip=h["ip"] + "/24", defaultRoute="via " + h["router_ip"])
        net.addLink(
            host,
            router,
            cls=Link,
            intfName1=h["intf"],
            intfName2=h["router_intf"],
            params1={"ip": h["ip"] + "/24"},
            params2={"ip": h["router_ip"] + "/24"},
        )
        hosts.append(host)
    net.build()
    for host in hosts:
        host.cmd("ip link set lo up")
    pids = {node.name: node.pid for node in [router, *hosts]}
    sys.stdout.write("AUREM " + json.dumps({"pids": pids}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    net.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
