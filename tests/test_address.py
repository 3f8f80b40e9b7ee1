"""One address syntax for every plane: host:port, bracketed IPv6, relay addresses, clear refusals."""

from __future__ import annotations

import pytest

from meshd.address import Address, AddressError, relay_address


@pytest.mark.parametrize(("text", "host", "port", "relay"), [
    ("127.0.0.1:7700", "127.0.0.1", 7700, False),
    ("peer.example:0", "peer.example", 0, False),
    ("[::1]:7700", "::1", 7700, False),
    ("[fe80::1%eth0]:80", "fe80::1%eth0", 80, False),
    ("relay:198.51.100.7:7800", "198.51.100.7", 7800, True),
    ("relay:[2001:db8::5]:7800", "2001:db8::5", 7800, True),
])
def test_addresses_parse_and_print_back(text, host, port, relay):
    address = Address.parse(text)
    assert (address.host, address.port, address.relay) == (host, port, relay)
    assert str(address) == text
    assert Address.parse(str(address)) == address


@pytest.mark.parametrize("text", ["", "7700", "host", "host:", ":7700", "host:port", "127.0.0.1:99999",
                                  "::1:7700", "[::1]7700", "[::1", "host:-1", "relay:", "a b:1"])
def test_malformed_addresses_are_refused_with_the_reason(text):
    with pytest.raises(AddressError, match=r"address|host|port"):
        Address.parse(text)


def test_a_relay_address_names_the_relay_it_goes_through():
    via = relay_address("[::1]:7800")
    assert via.relay and str(via) == "relay:[::1]:7800"
    assert via.endpoint == Address("::1", 7800) and not via.endpoint.relay
    assert Address.parse("127.0.0.1:0").with_port(4242) == Address("127.0.0.1", 4242)
