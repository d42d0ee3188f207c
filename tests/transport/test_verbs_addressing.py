"""Verbs addressing on a routed fabric: GID choice, hop limit, the AH options, NIC by address.

The routed host: two NICs, each alone on its rack's subnet, the racks joined through a
spine by two routers — a spine-leaf L3 RoCE v2 fabric in miniature (`sim.net`). On it a
QP whose address vector names a link-local GID, or whose hop limit the two routers use
up, hears nothing back and ends in RETRY_EXC_ERR, exactly as on hardware; the defaults
connect. Engines bind the rack addresses (127.0.1.5, 127.0.2.7: loopback addresses, so
their control listeners really bind them) and each takes the NIC holding its address.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from pdxfer.transport import CapabilityError, PeerLostError
from pdxfer.transport.verbs import nics, sim
from pdxfer.transport.verbs.sim.net import ROCE_V1, ROCE_V2, SimNic, SimPort, Topology, gid_text

from pdxfer import transport

WAIT = 10.0
RACK_A, RACK_B = "127.0.1.5", "127.0.2.7"
ROUTED = Topology(
    nics=(SimNic("soft0", ("pci0000:00", "0000:00:02.0", "0000:03:00.0"), (SimPort("rack-a", RACK_A),)),
          SimNic("soft1", ("pci0000:00", "0000:00:03.0", "0000:04:00.0"), (SimPort("rack-b", RACK_B),))),
    routers=(("rack-a", "spine"), ("spine", "rack-b")))


def _round_trip(tx_options: dict, rx_options: dict, topology: Topology = ROUTED,
                tx_host: str = RACK_A, rx_host: str = RACK_B) -> tuple:
    """One 64 KiB write across the fabric: `(tx port, rx port, error or None)`."""
    with sim.use(sim.Fabric(topology, retry_timeout=0.05)):  # retries give up fast
        tx = transport.create("verbs-sim", host=tx_host, **tx_options)
        rx = transport.create("verbs-sim", host=rx_host, **rx_options)
        try:
            src = torch.from_numpy(np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8))
            dst = torch.zeros(1 << 16, dtype=torch.uint8)
            a, b = tx.register(src), rx.register(dst)
            conn = tx.connect(rx.address())
            try:
                conn.write(a, b.descriptor(), np.array([[0, 0, 1 << 16]], np.int64)).wait(WAIT)
            except PeerLostError as exc:
                return tx.nic, rx.nic, exc
            assert torch.equal(dst, src)
            return tx.nic, rx.nic, None
        finally:
            tx.close()
            rx.close()


def test_defaults_connect_across_two_routers_on_the_gid_of_the_bound_address() -> None:
    tx, rx, error = _round_trip({}, {})
    assert error is None
    assert (tx.device, rx.device) == ("soft0", "soft1")  # each the NIC holding its address
    assert tx.gid_index == 3 and tx.gid == gid_text(nics.ipaddress.IPv6Address(f"::ffff:{RACK_A}"))
    assert "RoCE v2, the bound address 127.0.1.5" in tx.why and "holds the bound address" in tx.why


@pytest.mark.parametrize("side", ["tx", "rx"])
def test_a_hop_limit_the_routers_use_up_fails_as_on_hardware(side: str) -> None:
    # Two routers: hop_limit 2 dies at the second. On the receiving side it is the ACKs that die.
    options = {"hop_limit": 2}
    _, _, error = _round_trip(options if side == "tx" else {}, options if side == "rx" else {})
    assert error is not None
    assert "retry exceeded error (status 12" in str(error)
    _, _, error = _round_trip({"hop_limit": 3}, {"hop_limit": 3})
    assert error is None


def test_hop_limit_one_fails_across_a_router() -> None:
    # pyverbs' GlobalRoute default, kept by this backend before #20.
    _, _, error = _round_trip({"hop_limit": 1}, {})
    assert error is not None and "retry exceeded" in str(error)


def test_a_link_local_gid_fails_across_a_router_and_works_on_one_subnet() -> None:
    # Index 1 is the first RoCE v2 GID of an mlx5 table: fe80::, never forwarded by a router.
    _, _, error = _round_trip({"gid_index": 1}, {})
    assert error is not None and "retry exceeded" in str(error)
    flat = Topology(nics=tuple(SimNic(n.name, n.pci, (SimPort("lan0", n.ports[0].ipv4),))
                               for n in ROUTED.nics))
    tx, _, error = _round_trip({"gid_index": 1}, {}, flat)
    assert error is None and tx.gid_index == 1 and tx.why.endswith("pinned by gid_index")


def test_a_roce_v1_gid_is_l2_only() -> None:
    _, _, error = _round_trip({"gid_index": 2}, {"gid_index": 2})
    assert error is not None and "retry exceeded" in str(error)


def test_infiniband_uses_lids_in_a_subnet_and_the_grh_across_a_router() -> None:
    flat = Topology(nics=(SimNic("ib0", ("pci0000:00", "0000:00:02.0", "0000:03:00.0"),
                                 (SimPort("ib-a", infiniband=True, lid=7),)),
                          SimNic("ib1", ("pci0000:00", "0000:00:03.0", "0000:04:00.0"),
                                 (SimPort("ib-a", infiniband=True, lid=9),))))
    tx, rx, error = _round_trip({"device": "ib0"}, {"device": "ib1"}, flat, "127.0.0.1", "127.0.0.1")
    assert error is None and (tx.lid, rx.lid) == (7, 9) and not tx.ethernet
    assert not nics.needs_grh(tx, rx.gid)  # one subnet: LID routing, no GRH
    routed = Topology(nics=tuple(SimNic(n.name, n.pci, (SimPort(s, infiniband=True, lid=n.ports[0].lid),))
                                 for n, s in zip(flat.nics, ("ib-a", "ib-b"), strict=True)),
                      routers=(("ib-a", "ib-b"),))
    tx, rx, error = _round_trip({"device": "ib0"}, {"device": "ib1"}, routed, "127.0.0.1", "127.0.0.1")
    assert error is None and nics.needs_grh(tx, rx.gid)
    _, _, error = _round_trip({"device": "ib0", "hop_limit": 1}, {"device": "ib1"}, routed,
                              "127.0.0.1", "127.0.0.1")
    assert error is not None and "retry exceeded" in str(error)


def test_traffic_class_and_sl_reach_every_qps_address_vector() -> None:
    with sim.use(sim.Fabric(ROUTED)) as fab:
        tx = transport.create("verbs-sim", host=RACK_A, traffic_class=106, sl=3, hop_limit=9)
        rx = transport.create("verbs-sim", host=RACK_B, traffic_class=104, sl=5)
        try:
            conn = tx.connect(rx.address())
            (inbound,) = [p for p in rx.inbound.links() if p.sender]
            out, back = fab.qps[conn.qpns[0]].ah, fab.qps[inbound.qps[0].qp_num].ah
            assert (out.traffic_class, out.sl, out.hop_limit, out.sgid_index) == (106, 3, 9, 3)
            assert (back.traffic_class, back.sl, back.hop_limit) == (104, 5, 64)
            assert "hop_limit 9, traffic_class 106, sl 3" in tx.describe()
        finally:
            tx.close()
            rx.close()


@pytest.mark.parametrize(("option", "value", "message"), [
    ("hop_limit", 0, r"hop_limit must be an int in 1\.\.255, got 0"),
    ("hop_limit", 256, r"hop_limit must be an int in 1\.\.255"),
    ("traffic_class", -1, r"traffic_class must be an int in 0\.\.255"),
    ("sl", 16, r"sl must be an int in 0\.\.15, got 16"),
    ("sl", True, r"sl must be an int"),
    ("gid_index", -1, r"gid_index must be a non-negative int"),
    ("gid_index", 9, r"gid_index=9: port 1 of soft0 has no GID there \(populated: \[0, 1, 2, 3\]\)"),
])
def test_bad_addressing_options_are_refused_naming_the_range(option: str, value: object, message: str) -> None:
    with pytest.raises(CapabilityError, match=message):
        transport.create("verbs-sim", **{option: value})


# -- the choice rules, on GID tables as mlx5 fills them ------------------------------------------

def _port(*gids: tuple[str, int], ethernet: bool = True, name: str = "mlx5_0") -> nics.PortInfo:
    table = tuple(nics.Gid(i, gid_text(nics.ipaddress.IPv6Address(a)), k == ROCE_V2)
                  for i, (a, k) in enumerate(gids))
    return nics.PortInfo(name, 1, ethernet, 0, 5, table, 256, 8, 4096, 1 << 30, None)


MLX5 = _port(("fe80::ac0:ebff:fe3d:ca54", ROCE_V1), ("fe80::ac0:ebff:fe3d:ca54", ROCE_V2),
             ("::ffff:10.0.0.5", ROCE_V1), ("::ffff:10.0.0.5", ROCE_V2),
             ("::ffff:10.1.0.5", ROCE_V2), ("2001:db8::5", ROCE_V2))


@pytest.mark.parametrize(("host", "index", "why"), [
    ("10.1.0.5", 4, "the bound address 10.1.0.5"),
    ("10.0.0.5", 3, "the bound address 10.0.0.5"),
    ("0.0.0.0", 3, "first IPv4 address"),  # wildcard: the first routable IPv4 GID, never fe80::
    ("127.0.0.1", 3, "first IPv4 address"),
    ("::", 3, "first IPv4 address"),
    ("::1", 5, "first IPv6 address"),
    ("2001:db8::5", 5, "the bound address 2001:db8::5"),
])
def test_the_gid_is_the_bound_address_else_a_routable_one_of_its_family(host: str, index: int,
                                                                        why: str) -> None:
    gid, reason = nics.choose_gid(MLX5, nics.bound_address(host))
    assert (gid.index, why in reason) == (index, True), reason


def test_link_local_only_is_a_last_resort_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    port = _port(("fe80::1", ROCE_V1), ("fe80::1", ROCE_V2))
    with caplog.at_level(logging.WARNING):
        gid, why = nics.choose_gid(port, None)
    assert gid.index == 1 and "link-local (not routable)" in why
    assert "only link-local RoCE v2 GIDs" in caplog.text
    with pytest.raises(CapabilityError, match="has no RoCE v2 GID; configure an IP address"):
        nics.choose_gid(_port(("fe80::1", ROCE_V1)), None)


def test_infiniband_takes_gid_zero_and_the_port_holding_the_address_wins() -> None:
    ib = _port(("fe80::2c9:300:1:2", ROCE_V1), ethernet=False)
    assert nics.choose_gid(ib, nics.bound_address("10.0.0.5"))[0].index == 0
    other = _port(("::ffff:10.9.0.1", ROCE_V2), name="mlx5_1")
    chosen, why = nics.choose_port([other, MLX5], host=nics.bound_address("10.1.0.5"))
    assert chosen is MLX5 and why == "holds the bound address 10.1.0.5"
    chosen, why = nics.choose_port([other, MLX5], host=None)
    assert chosen is other and why == "the first ACTIVE port"
