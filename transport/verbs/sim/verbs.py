"""A software verbs fabric with pyverbs' surface: the classes the verbs backend uses, no more.

`api.load()` returns real pyverbs and `sim.namespace()` this module under
the same names, so the backend runs unchanged on an RDMA NIC and, in every
test run, on `nic.Fabric` — a NIC thread in this process. The surface is
exactly what `transport/verbs/*.py` touches (tests/transport/
test_verbs_pyverbs.py checks every such attribute exists on the real classes
and that objects built by `build.py` read back the same on both).

Strictness follows the strictest supported pyverbs (rdma-core 44): a RecvWR
needs at least one SGE, `SendWR.sg_list` cannot be read back,
`send_flags` defaults to SIGNALED and `sq_sig_all` to 1, and a QP outside RTS
refuses `post_send` with EINVAL. WR fields are copied when posted, as a WQE
is; the linked list is walked through `next_wr` at `post_send`.

Devices, ports and GID tables are the fabric's topology (`net.Topology`:
one device `soft0` unless a test installs another host). `DmaBufMR` maps a
dma-buf the fabric's CUDA double exported (`gpu.py`); any other fd fails
with EOPNOTSUPP, as a NIC without dma-buf support does. Deliberately
absent: CompChannel, MW, SRQ, extended QPs.
"""

from __future__ import annotations

import enum
import errno
import types
from typing import Any

import pdxfer.transport.verbs.sim.current as current
import pdxfer.transport.verbs.sim.gpu as gpu_double  # absolute: `from . import` runs sim/__init__
import pdxfer.transport.verbs.sim.net as net
import pdxfer.transport.verbs.sim.nic as nic


class PyverbsError(Exception):
    """Mirror of pyverbs.pyverbs_error.PyverbsError."""


class PyverbsRDMAError(PyverbsError):
    """Mirror of pyverbs.pyverbs_error.PyverbsRDMAError: a message and an errno."""

    def __init__(self, msg: str, error_code: int = -1) -> None:
        self.error_code = error_code
        super().__init__(f"{msg}. Errno: {error_code}, {errno.errorcode.get(error_code, '')}")


class _E(types.SimpleNamespace):
    pass


E = _E(
    ibv_wr_opcode=enum.IntEnum("ibv_wr_opcode", {"IBV_WR_RDMA_WRITE": 0, "IBV_WR_SEND": 2}),
    ibv_qp_type=enum.IntEnum("ibv_qp_type", {"IBV_QPT_RC": 2}),
    ibv_access_flags=enum.IntFlag("ibv_access_flags", {"IBV_ACCESS_LOCAL_WRITE": 1,
                                                       "IBV_ACCESS_REMOTE_WRITE": 2}),
    ibv_send_flags=enum.IntFlag("ibv_send_flags", {"IBV_SEND_SIGNALED": 2}),
    ibv_qp_state=enum.IntEnum("ibv_qp_state", {"IBV_QPS_RESET": 0, "IBV_QPS_INIT": 1, "IBV_QPS_RTR": 2,
                                               "IBV_QPS_RTS": 3, "IBV_QPS_ERR": 6}),
    ibv_qp_attr_mask=enum.IntFlag("ibv_qp_attr_mask", {"IBV_QP_STATE": 1}),
    ibv_port_state=enum.IntEnum("ibv_port_state", {"IBV_PORT_DOWN": 1, "IBV_PORT_ACTIVE": 4}),
    ibv_mtu=enum.IntEnum("ibv_mtu", {"IBV_MTU_1024": 3, "IBV_MTU_4096": 5}),
    ibv_wc_opcode=enum.IntEnum("ibv_wc_opcode", {"IBV_WC_SEND": 0, "IBV_WC_RDMA_WRITE": 1,
                                                 "IBV_WC_RECV": 128}),
    ibv_wc_status=enum.IntEnum("ibv_wc_status", {
        "IBV_WC_SUCCESS": 0, "IBV_WC_LOC_LEN_ERR": 1, "IBV_WC_LOC_PROT_ERR": 4,
        "IBV_WC_WR_FLUSH_ERR": 5, "IBV_WC_REM_INV_REQ_ERR": 9, "IBV_WC_REM_ACCESS_ERR": 10,
        "IBV_WC_RETRY_EXC_ERR": 12, "IBV_WC_RNR_RETRY_EXC_ERR": 13}),
    ibv_gid_type_sysfs=enum.IntEnum("ibv_gid_type_sysfs", {"IBV_GID_TYPE_SYSFS_IB_ROCE_V1": 0,
                                                           "IBV_GID_TYPE_SYSFS_ROCE_V2": 1}),
    IBV_LINK_LAYER_INFINIBAND=1,
    IBV_LINK_LAYER_ETHERNET=2,
)
_STATUS_TEXT = {0: "success", 1: "local length error", 4: "local protection error",
                5: "Work Request Flushed Error", 9: "invalid request error",
                10: "remote access error", 12: "retry exceeded error",
                13: "RNR retry counter exceeded"}


def cqe_status_to_str(status: int) -> str:
    """As pyverbs.cq.cqe_status_to_str."""
    return _STATUS_TEXT.get(int(status), f"unknown status {status}")


def fabric() -> nic.Fabric:
    """The fabric the soft devices of this process sit on (for fault injection in tests)."""
    return current.default_fabric()


class _Attrs:
    """A plain attribute bag with the defaults pyverbs gives an unset field."""

    _defaults: dict[str, Any] = {}

    def __init__(self, **kw: Any) -> None:
        for k, v in {**self._defaults, **kw}.items():
            if k not in self._defaults:
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument '{k}'")
            setattr(self, k, v)


class Device(_Attrs):
    _defaults = {"name": b"soft0"}


def get_device_list() -> list[Device]:
    return [Device(name=n.name.encode()) for n in current.default_fabric().net.topology.nics]


class DeviceAttr(_Attrs):
    _defaults = {"max_qp_wr": 0, "max_sge": 0, "max_cqe": 0, "max_mr_size": 0}


class PortAttr(_Attrs):
    _defaults = {"state": 0, "active_mtu": 0, "lid": 0, "link_layer": 0, "max_msg_sz": 0,
                 "gid_tbl_len": 0}


class GID:
    def __init__(self, val: str | None = None) -> None:
        self.gid = val or "0000:0000:0000:0000:0000:0000:0000:0000"


class Context:
    def __init__(self, name: str | bytes = "soft0") -> None:
        name = name.decode() if isinstance(name, bytes) else name
        self.fabric = current.default_fabric()
        if self.fabric.net.nic(name) is None:
            raise PyverbsRDMAError(f"Failed to open device {name}", errno.ENODEV)
        self.name = name
        self.children: list[Any] = []

    def query_device(self) -> DeviceAttr:
        f = self.fabric
        return DeviceAttr(max_qp_wr=f.max_qp_wr, max_sge=f.max_sge, max_cqe=f.max_cqe,
                          max_mr_size=1 << 40)

    def _port(self, port_num: int) -> net.PortState:
        found = self.fabric.net.ports.get((self.name, port_num))
        if found is None:
            raise PyverbsRDMAError(f"Failed to query port {port_num}", errno.EINVAL)
        return found

    def query_port(self, port_num: int) -> PortAttr:
        p = self._port(port_num)
        return PortAttr(state=4 if p.spec.active else 1, active_mtu=5, lid=p.spec.lid,
                        link_layer=1 if p.spec.infiniband else 2, max_msg_sz=self.fabric.max_msg_sz,
                        gid_tbl_len=len(p.gids) + 2)  # unpopulated entries too, as on a NIC

    def query_gid(self, port_num: int, index: int) -> GID:
        gids = self._port(port_num).gids
        return GID(gids[index].text if index < len(gids) else None)

    def query_gid_type(self, port_num: int, index: int) -> int:
        gids = self._port(port_num).gids
        if index >= len(gids):
            raise PyverbsRDMAError(f"Failed to query gid type of index {index}", errno.ENODATA)
        return gids[index].kind

    def close(self) -> None:
        for child in reversed(self.children):
            child.close()
        self.children.clear()


class PD:
    def __init__(self, context: Context) -> None:
        self.context = context
        context.children.append(self)

    def close(self) -> None:
        pass


class MR:
    def __init__(self, creator: PD, length: int, access: int, address: int | None = None) -> None:
        if not address:
            raise PyverbsRDMAError("soft verbs registers caller memory only (address=)", errno.EINVAL)
        self.sim_state = creator.context.fabric.add_mr(creator, int(address), int(length), int(access))
        self.fabric = creator.context.fabric
        self.lkey = self.rkey = self.sim_state.key
        self.length = int(length)
        creator.context.children.append(self)

    def close(self) -> None:
        self.fabric.close_mr(self.sim_state)


class DmaBufMR:
    """An MR over a dma-buf: its address space is [offset, offset + length) (iova = offset, as v44)."""

    def __init__(self, pd: PD, length: int, access: int, dmabuf: int = -1, offset: int = 0) -> None:
        fab = pd.context.fabric
        try:
            gpu = fab.cuda.gpu_of(dmabuf)
        except OSError:
            gpu = None
        if gpu is None:
            raise PyverbsRDMAError("Failed to register a dma-buf MR", errno.EOPNOTSUPP)
        span = int(offset) + int(length)
        host = gpu_double.map_fd(dmabuf, span)
        self.sim_state = fab.add_mr(pd, int(offset), int(length), int(access), shift=host,
                                    gpu=gpu if fab.cuda.staged(gpu) else None,
                                    unmap=lambda: gpu_double.unmap(host, span))
        self.fabric = fab
        self.lkey = self.rkey = self.sim_state.key
        self.length = int(length)
        pd.context.children.append(self)

    def close(self) -> None:
        self.fabric.close_mr(self.sim_state)


class WC(_Attrs):
    _defaults = {"wr_id": 0, "status": 0, "opcode": 0, "byte_len": 0, "qp_num": 0, "vendor_err": 0}


class CQ:
    def __init__(self, context: Context, cqe: int, cq_context: Any = None, channel: Any = None,
                 comp_vector: int = 0) -> None:
        if cqe > context.fabric.max_cqe:
            raise PyverbsRDMAError("Failed to create a CQ", errno.EINVAL)
        self.sim_state = nic.CQState(cqe)
        self.fabric = context.fabric
        self.cqe = cqe

    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        got = self.fabric.poll(self.sim_state, num_entries)
        wcs = [WC(wr_id=w, status=s, opcode=o, byte_len=n, qp_num=q) for w, s, o, n, q in got]
        return len(wcs), wcs

    def close(self) -> None:
        pass


class QPCap(_Attrs):
    _defaults = {"max_send_wr": 1, "max_recv_wr": 10, "max_send_sge": 1, "max_recv_sge": 1,
                 "max_inline_data": 0}


class QPInitAttr(_Attrs):
    _defaults = {"qp_type": 2, "qp_context": None, "scq": None, "rcq": None, "srq": None,
                 "cap": None, "sq_sig_all": 1}


class GlobalRoute(_Attrs):
    _defaults = {"dgid": None, "flow_label": 0, "sgid_index": 0, "hop_limit": 1, "traffic_class": 0}


class AHAttr(_Attrs):
    _defaults = {"dlid": 0, "sl": 0, "src_path_bits": 0, "static_rate": 0, "is_global": 0,
                 "port_num": 1, "gr": None}

    # pyverbs reads the GRH fields through the AH attr
    dgid = property(lambda self: self.gr.dgid.gid if self.gr is not None else None)
    sgid_index = property(lambda self: self.gr.sgid_index if self.gr is not None else 0)
    hop_limit = property(lambda self: self.gr.hop_limit if self.gr is not None else 0)
    traffic_class = property(lambda self: self.gr.traffic_class if self.gr is not None else 0)
    flow_label = property(lambda self: self.gr.flow_label if self.gr is not None else 0)


class QPAttr(_Attrs):
    _defaults = {"qp_state": 0, "cur_qp_state": 0, "path_mtu": 3, "port_num": 1, "pkey_index": 0,
                 "qp_access_flags": 0, "dest_qp_num": 0, "rq_psn": 0, "sq_psn": 0,
                 "max_dest_rd_atomic": 0, "min_rnr_timer": 0, "timeout": 0, "retry_cnt": 0,
                 "rnr_retry": 0, "max_rd_atomic": 0, "ah_attr": None}


class SGE:
    def __init__(self, addr: int, length: int, lkey: int) -> None:
        if not 0 <= length < 1 << 32:
            raise OverflowError("value too large to convert to uint32_t")
        self.addr, self.length, self.lkey = int(addr), int(length), int(lkey)


class _WR:
    def sim_sges(self) -> list[tuple[int, int, int]]:
        return [(s.addr, s.length, s.lkey) for s in self._sg[:self.num_sge]]

    def _set_next(self, wr: Any) -> None:
        self.sim_next = wr

    next_wr = property(None, _set_next)  # v44: write-only from Python, a raw pointer inside


class SendWR(_WR):
    def __init__(self, wr_id: int = 0, opcode: int = 2, num_sge: int = 0, imm_data: int = 0,
                 sg: list[SGE] | None = None, send_flags: int = 2) -> None:
        if num_sge and (sg is None or len(sg) < num_sge):
            raise PyverbsError("num_sge is larger than the SGE list")
        self.wr_id, self.opcode, self.num_sge = wr_id, int(opcode), num_sge
        self.imm_data, self.send_flags = imm_data, int(send_flags)
        self._sg, self.sim_next = list(sg or []), None
        self.sim_rkey = self.sim_raddr = 0  # write-only, as in pyverbs (its `rkey` is another field)

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.sim_rkey, self.sim_raddr = int(rkey), int(addr)


class RecvWR(_WR):
    def __init__(self, wr_id: int = 0, num_sge: int = 0, sg: list[SGE] | None = None) -> None:
        if num_sge < 1 or sg is None:
            raise PyverbsError("A WR needs at least one SGE")
        self.wr_id, self.num_sge, self._sg, self.sim_next = wr_id, num_sge, list(sg), None


_TRANSITIONS = {(0, 1), (1, 1), (1, 2), (2, 3), (3, 3)}


class QP:
    def __init__(self, creator: PD, init_attr: QPInitAttr) -> None:
        ctx = creator.context
        cap = init_attr.cap
        if (init_attr.qp_type != 2 or cap.max_send_wr > ctx.fabric.max_qp_wr
                or cap.max_recv_wr > ctx.fabric.max_qp_wr or cap.max_send_sge > ctx.fabric.max_sge):
            raise PyverbsRDMAError("Failed to create QP", errno.EINVAL)
        self.fabric, self.context = ctx.fabric, ctx
        self._sig_all = bool(init_attr.sq_sig_all)
        self.sim_state = ctx.fabric.add_qp(creator, init_attr.scq.sim_state, init_attr.rcq.sim_state, cap)
        self.qp_num = self.sim_state.qpn
        self.qp_type = 2
        ctx.children.append(self)

    @property
    def qp_state(self) -> int:
        return self.sim_state.state

    def modify(self, qp_attr: QPAttr, comp_mask: int) -> None:
        to = qp_attr.qp_state
        if to not in (0, 6) and (self.sim_state.state, to) not in _TRANSITIONS:
            raise PyverbsRDMAError(f"Failed to modify QP state to {to}", errno.EINVAL)
        s = self.sim_state
        if to == 1:
            s.access = qp_attr.qp_access_flags
            s.port = (self.context.name, qp_attr.port_num)
        elif to == 2:
            s.dest = qp_attr.dest_qp_num
            s.ah = self._ah(qp_attr.ah_attr)
        elif to == 3:
            s.rnr_retry = qp_attr.rnr_retry
        self.fabric.set_state(s, to)

    def _ah(self, ah: AHAttr) -> net.Ah:
        """The address vector, refused as a NIC refuses it: RoCE needs a GRH with a GID of the port."""
        port = self.fabric.net.ports[self.sim_state.port]
        if ah is None or (not port.spec.infiniband and not ah.is_global) or (
                ah.is_global and not 0 <= ah.sgid_index < len(port.gids)):
            raise PyverbsRDMAError("Failed to modify QP state to RTR", errno.EINVAL)
        return net.Ah(bool(ah.is_global), ah.dgid or "", ah.sgid_index, ah.hop_limit, ah.traffic_class,
                      ah.dlid, ah.sl, ah.port_num)

    def to_init(self, qp_attr: QPAttr) -> None:
        qp_attr.qp_state = 1
        self.modify(qp_attr, 0)

    def to_rtr(self, qp_attr: QPAttr) -> None:
        if self.qp_state != 1:
            self.to_init(qp_attr)
        qp_attr.qp_state = 2
        self.modify(qp_attr, 0)

    def to_rts(self, qp_attr: QPAttr) -> None:
        if self.qp_state != 2:
            self.to_rtr(qp_attr)
        qp_attr.qp_state = 3
        self.modify(qp_attr, 0)

    def post_send(self, send_wr: SendWR, bad_wr: Any = None) -> None:
        if self.sim_state.state not in (3, 6):
            raise PyverbsRDMAError("Failed to post send", errno.EINVAL)
        wqes, wr = [], send_wr
        while wr is not None:
            sges = wr.sim_sges()
            if wr.num_sge > self.sim_state.max_send_sge:
                raise PyverbsRDMAError("Failed to post send", errno.EINVAL)
            signaled = self._sig_all or bool(wr.send_flags & 2)
            wqes.append(nic.WQE(wr.wr_id, wr.opcode, signaled, sges, wr.sim_rkey, wr.sim_raddr,
                                sum(n for _, n, _ in sges)))
            wr = wr.sim_next
        if self.fabric.post_send(self.sim_state, wqes) < len(wqes):
            raise PyverbsRDMAError("Failed to post send", errno.ENOMEM)

    def post_recv(self, wr: RecvWR, bad_wr: Any = None) -> None:
        if self.sim_state.state == 0:
            raise PyverbsRDMAError("Failed to post recv", errno.EINVAL)
        while wr is not None:
            if not self.fabric.post_recv(self.sim_state, nic.WQE(wr.wr_id, 0, True, wr.sim_sges())):
                raise PyverbsRDMAError("Failed to post recv", errno.ENOMEM)
            wr = wr.sim_next

    def close(self) -> None:
        self.fabric.destroy_qp(self.sim_state)
