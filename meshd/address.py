"""Network addresses as every part of meshd writes them: ``HOST:PORT``, ``[IPV6]:PORT``, ``relay:HOST:PORT``.

One parser and one printer, so that the transport, gossip, cards, the relay and the command line
agree on every edge case: IPv6 hosts are bracketed in text and bare in :attr:`Address.host`; a port
is 0-65535 (0 only where a listener lets the kernel choose); a relay address names the
``meshd-relay`` through which a peer is reached rather than the peer itself.
"""

from __future__ import annotations

from dataclasses import dataclass

RELAY_PREFIX = "relay:"


class AddressError(ValueError):
    """Text that is not a valid address; the message says what was expected."""


@dataclass(frozen=True, order=True)
class Address:
    """A host and port; ``relay`` marks the address of a relay that carries the connection."""

    host: str
    port: int
    relay: bool = False

    def __post_init__(self) -> None:
        if not self.host or any(c in self.host for c in "[]/ \t"):
            raise AddressError(f"bad host {self.host!r}")
        if not 0 <= self.port <= 65535:
            raise AddressError(f"port {self.port} is outside 0-65535")

    @classmethod
    def parse(cls, text: str) -> Address:
        """Read ``HOST:PORT``, ``[IPV6]:PORT`` or either behind ``relay:``."""
        if not isinstance(text, str):
            raise AddressError(f"an address is text, not {type(text).__name__}")
        rest = text.strip()
        relay = rest.startswith(RELAY_PREFIX)
        rest = rest.removeprefix(RELAY_PREFIX)
        if rest.startswith("["):
            host, sep, tail = rest[1:].partition("]")
            if not sep or not tail.startswith(":"):
                raise AddressError(f"bad address {text!r}; expected [IPV6]:PORT")
            port_text = tail[1:]
        else:
            host, sep, port_text = rest.rpartition(":")
            if not sep or not host:
                raise AddressError(f"bad address {text!r}; expected HOST:PORT")
            if ":" in host:
                raise AddressError(f"bad address {text!r}; write an IPv6 host in brackets: [{host}]:{port_text}")
        if not port_text.isdigit():
            raise AddressError(f"bad address {text!r}: the port must be a number")
        try:
            return cls(host, int(port_text), relay)
        except AddressError as exc:
            raise AddressError(f"bad address {text!r}: {exc}") from None

    @classmethod
    def coerce(cls, value: Address | str) -> Address:
        return value if isinstance(value, Address) else cls.parse(value)

    @property
    def host_text(self) -> str:
        """The host as written in ``HOST:PORT`` (bracketed when it is IPv6)."""
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def endpoint(self) -> Address:
        """Where to open a socket: the relay itself for a relay address, else this address."""
        return Address(self.host, self.port) if self.relay else self

    def with_port(self, port: int) -> Address:
        return Address(self.host, port, self.relay)

    def __str__(self) -> str:
        return f"{RELAY_PREFIX if self.relay else ''}{self.host_text}:{self.port}"


def relay_address(relay: Address | str) -> Address:
    """The address a card carries for a peer reachable through ``relay`` (a relay's ``HOST:PORT``)."""
    endpoint = Address.coerce(relay)
    return Address(endpoint.host, endpoint.port, relay=True)
