"""``udp://group:port`` starting points of router.client (router.client.discovered), parsing."""

import pytest

from router.client.discovered import DiscoverySpec, parse_discovery_url
from router.client.topology import UrlListError


def test_defaults_and_options():
    assert parse_discovery_url("udp://231.7.7.7:9876") == DiscoverySpec("231.7.7.7", 9876)
    assert parse_discovery_url("udp://231.7.7.7:9876?refresh-timeout=1500&initial-wait-timeout=0"
                               "&local-bind-address=127.0.0.1&cluster=c1&key=k") == \
        DiscoverySpec("231.7.7.7", 9876, 1.5, 0.0, "127.0.0.1", "c1", "k")


@pytest.mark.parametrize("url, says", [
    ("udp://10.0.0.1:9876", "multicast"),
    ("udp://231.7.7.7", "multicast"),
    ("tcp://231.7.7.7:1", "multicast"),
    ("udp://host:1", "multicast"),
    ("udp://231.7.7.7:9876?refresh=1", "unknown option 'refresh'"),
    ("udp://231.7.7.7:9876?refresh-timeout=0", "refresh-timeout"),
    ("udp://231.7.7.7:9876?initial-wait-timeout=soon", "initial-wait-timeout"),
    ("udp://231.7.7.7:9876?local-bind-address=x", "local-bind-address"),
])
def test_bad_urls(url, says):
    with pytest.raises(UrlListError) as e:
        parse_discovery_url(url)
    assert says in str(e.value)
