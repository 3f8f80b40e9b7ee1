"""Trace parity: one request through a route with its hidden states read at every seam (and after
every layer), compared with one process computing the whole model in the same numerics class.

:mod:`meshd.trace.run` runs inputs through a shard and reads what each layer gave (the hops and the
one-process reference run the very same function); :mod:`meshd.trace.service` answers a peer's
``trace`` request with it; :mod:`meshd.trace.compare` measures how far two traces are apart;
:mod:`meshd.trace.parity` drives a whole trace from the entry and says where parity first fails.
"""
