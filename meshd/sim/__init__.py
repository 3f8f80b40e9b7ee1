"""The control plane of many peers in one process: the real sans-IO gossip, failure detection and
election over a simulated network with latency, loss and partitions, on a fake clock
(:mod:`meshd.sim.mesh`), and the scenarios ``meshctl sim`` measures (:mod:`meshd.sim.scenarios`)."""
