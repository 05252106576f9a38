"""WAN emulation: network namespaces joined through a router namespace with an htb bottleneck."""
