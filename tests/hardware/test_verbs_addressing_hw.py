"""Verbs addressing and NIC choice on a real host: what the software fabric models, checked on hardware.

The fabric (tests/transport/test_verbs_addressing.py, test_verbs_gpu.py) proves the rules
against its own model of GID tables, routers and PCIe trees; here the same rules meet a
real NIC: the GID chosen is a RoCE v2 GID holding the bound address, never link-local;
every QP's address vector carries the hop limit, traffic class and SL given; each GPU's
memory gets a NIC `nvidia-smi topo -m` rates nearest; and, where a second host behind a
router runs `receiver_proc.py` (its line in `PDXFER_VERBS_PEER`), the defaults reach it
and `hop_limit=1` ends in RETRY_EXC_ERR. Skips without a device (conftest.py).
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess

import msgpack
import numpy as np
import pytest
import torch
from pdxfer.transport.verbs import nics, topology
from pdxfer.transport.verbs.api import load

from pdxfer import transport

WAIT = 60.0
PEER = os.environ.get("PDXFER_VERBS_PEER")


def test_the_default_gid_is_roce_v2_holding_the_bound_address() -> None:
    ports, _ = nics.scan(load())
    tried = 0
    for info in (p for p in ports if p.ethernet):
        for gid in (g for g in info.gids if g.roce_v2 and g.address.ipv4_mapped is not None):
            host = str(gid.address.ipv4_mapped)
            with transport.create("verbs", host=host, device=info.device, port_num=info.port_num) as e:
                print(f"\n{e.describe()}")
                assert e.nic.gid == gid.text and "the bound address" in e.nic.why
            tried += 1
            break
        with transport.create("verbs", host="0.0.0.0", device=info.device, port_num=info.port_num) as e:
            routable = any(g.roce_v2 and not g.link_local for g in info.gids)
            assert not ipaddress.IPv6Address(e.nic.gid).is_link_local or not routable
    if not tried:
        pytest.skip("no RoCE port with an IPv4 address here (InfiniBand only)")


def test_every_qp_carries_the_hop_limit_traffic_class_and_sl() -> None:
    api = load()
    with transport.create("verbs", traffic_class=106, sl=3) as tx, transport.create("verbs") as rx:
        conn = tx.connect(rx.address())
        attr, _ = conn.qps[0].query(api.E.ibv_qp_attr_mask.IBV_QP_AV)
        ah = attr.ah_attr
        print(f"\n{tx.describe()}\nAH: global {ah.is_global} hop_limit {ah.hop_limit} "
              f"traffic_class {ah.traffic_class} sl {ah.sl} sgid_index {ah.sgid_index}")
        assert ah.sl == 3
        if tx.nic.ethernet:
            assert (ah.is_global, ah.hop_limit, ah.traffic_class) == (1, 64, 106)
            assert ah.sgid_index == tx.nic.gid_index


def _topo_nearest() -> dict[int, set[str]]:
    """GPU index -> the NIC names `nvidia-smi topo -m` rates nearest (best PCIe class)."""
    out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=60).stdout
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)", out, re.M))
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in out.splitlines()]
    header = next(line.split() for line in lines if line[:1].isspace() and "GPU0" in line.split())
    cols = [c for c in header if c.startswith(("GPU", "NIC"))]
    best: dict[int, set[str]] = {}
    for line in lines:
        cells = line.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        ranks = {legend[c]: topology.CLASSES.index(v) for c, v in zip(cols, cells[1:], strict=False)
                 if c in legend and v in topology.CLASSES}
        if ranks:
            top = min(ranks.values())
            best[int(cells[0][3:])] = {n for n, r in ranks.items() if r == top}
    return best


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi for the reference")
def test_each_gpus_memory_gets_a_nic_nvidia_smi_rates_nearest() -> None:
    active = {p.device for p in nics.scan(load())[0]}
    nearest = _topo_nearest()
    for gpu in range(torch.cuda.device_count()):
        with transport.create("verbs") as e:
            e.register(torch.zeros(4096, dtype=torch.uint8, device=f"cuda:{gpu}"))
            print(f"\ncuda:{gpu}: {e.describe()}")
            want = nearest.get(gpu, set()) & active
            if want:
                assert e.nic.device in want, f"cuda:{gpu} got {e.nic.device}; nvidia-smi: {sorted(want)}"


@pytest.mark.skipif(not PEER, reason="set PDXFER_VERBS_PEER to receiver_proc.py's line from a host "
                                     "behind a router")
def test_a_peer_behind_a_router_is_reached_with_defaults_and_not_with_hop_limit_1() -> None:
    peer = msgpack.unpackb(bytes.fromhex(PEER))
    n = peer["descriptor"]["length"]
    table = np.array([[0, 0, n]], np.int64)
    with transport.create("verbs") as tx:
        src = tx.register(torch.ones(n, dtype=torch.uint8))
        tx.connect(peer["address"]).write(src, peer["descriptor"], table).wait(WAIT)
        print(f"\n{tx.describe()}: reached {peer['address']['host']}")
    with transport.create("verbs", hop_limit=1) as tx:
        src = tx.register(torch.ones(n, dtype=torch.uint8))
        with pytest.raises(transport.PeerLostError, match="retry exceeded"):
            tx.connect(peer["address"]).write(src, peer["descriptor"], table).wait(WAIT)
