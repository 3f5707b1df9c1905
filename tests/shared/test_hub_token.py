"""A hub bound beyond loopback needs a token: refused before it binds (grpo ref-server) and by the checks before a
run starts (grpo run / check-config), one line naming the key."""

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deploy.preflight import port_problems
from ref_server.server import serve
from shared.config.loader import load_config
from shared.errors import UsageError
from shared.ports import is_loopback, token_problem


@given(st.ip_addresses())
def test_only_loopback_addresses_go_without_a_token(address):
    host = str(address)
    assert is_loopback(host) == address.is_loopback
    problem = token_problem(host, None)
    assert (problem is None) == address.is_loopback
    if problem:
        assert problem.startswith(f"ref_server.host: {host!r} is reachable from other machines and no token is set")
    assert token_problem(host, "s3cret") is None


def test_names_and_wildcards():
    assert is_loopback("localhost") and is_loopback("127.0.0.2") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("node1")
    assert ipaddress.ip_address("127.255.0.1").is_loopback and token_problem("127.255.0.1", None) is None


def test_the_ref_server_refuses_to_bind_beyond_loopback_without_a_token(monkeypatch):
    monkeypatch.delenv("GRPO_TOKEN", raising=False)
    config = load_config(None, ["ref_server.host=0.0.0.0"])
    with pytest.raises(UsageError, match=r"ref_server.host: '0.0.0.0' is reachable from other machines"):
        serve(config)
    assert any("no token is set" in p for p in port_problems(config))
    monkeypatch.setenv("GRPO_TOKEN", "s3cret")
    assert not any("token" in p for p in port_problems(config))
