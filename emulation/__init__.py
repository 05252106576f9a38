"""WAN emulation: a topology's regions as Linux network namespaces joined through a router
namespace that shapes each link direction (htb rate, BDP-sized queue, delay by netem or an
NFQUEUE delay line, loss by netem or iptables statistic, fluctuation, cut/restore).

Entry points: :func:`emulation.network.build_network` (the runtime's API),
:func:`emulation.cleanup.cleanup_leftovers`, ``aurora emulate`` (:mod:`emulation.cli`) and
:class:`emulation.netns.EmulatedLink` (the data plane's two-host benchmark link). Theory,
measured accuracy and what works on which kernel: ``docs/EMULATION.md``.
"""
