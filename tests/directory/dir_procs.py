"""The directory tests' handle on `dir_prefill_proc.py`: a registered prefill in its own process."""

from __future__ import annotations

from pathlib import Path

from pdxfer_procs import Proc

HERE = Path(__file__).resolve().parent


class DirPrefill(Proc):
    """`address` is its bootstrap address, `engine` its engine id (the incarnation)."""

    def __init__(self, etcd: str, cluster: str, *, ttl: float = 1.0, port: int = 0,
                 instance: str = "p0") -> None:
        super().__init__(str(HERE / "dir_prefill_proc.py"), "--etcd", etcd, "--cluster", cluster,
                         "--ttl", str(ttl), "--port", str(port), "--instance", instance)

    def line(self) -> str:
        out = super().line()
        if out.startswith("READY "):  # READY <address> <engine>: Proc reads two words
            _, address, self.engine = out.split()
            return f"READY {address}"
        return out

    def send(self, rid: str, kv: list[int], state: list[int]) -> None:
        csv = ",".join(map(str, state)) or "-"
        assert self.ask(f"send {rid} {','.join(map(str, kv))} {csv}") == f"SENT {rid}"

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])
