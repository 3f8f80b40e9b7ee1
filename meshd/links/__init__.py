"""Shaped links for testing and benchmarks: delay, jitter and rate applied to a peer's outgoing bytes
in user space (no kernel ``netem``), so a mesh on one machine can be measured as if its peers were
on a LAN, Wi-Fi or a WAN.

- ``profiles``: ``LinkShape``, the named profiles (``lan``, ``wifi``, ``wan``) and the parser of
  ``DELAY[±JITTER]/RATE``;
- ``shaper``: the link itself, sans-IO (bytes and the time in, release times out);
- ``stream``: ``ShapedStream``, the Trio adapter that wraps a byte stream's sends;
- ``calibrate``: what a shaped loopback connection actually delivers, against what it was set to.

``Transport`` wraps every connection it dials or accepts when its config has a ``link_shape``
(``meshd run --link-shape``), below TLS; a peer's connection to itself crosses no link and is not
shaped. Import from the modules: this package imports nothing, so
that reading a shape (the CLIs, the config) does not load Trio.
"""
