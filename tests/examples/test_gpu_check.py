"""The prepared GPU check (`make gpu-check`) runs its non-GPU parts here, on host memory.

GPU loans are rare and short: a script first run on a GPU would spend the
loan on its own bugs. So `--device cpu` runs the same sections, the same
code (batched copies, both backends' device paths, the engine, the two NIXL
processes) on host memory, and these tests check its output; without CUDA
and without `--device cpu` it must refuse, saying why.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from examples import gpu_check
from pdxfer import transport


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_refuses_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device here" in err and "pass --device cpu" in err
    assert not (tmp_path / "gpu_check.json").exists()


def test_host_run_of_the_in_process_sections_writes_exact_figures(tmp_path: Path) -> None:
    rc = gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--quick",
                         "--only", "attributes,copies,loopback,tcp,ucx,engine"])
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 0, res
    for section in ("copies", "loopback", "tcp") + (("ucx",) if "ucx-all" in transport.variants() else ()):
        assert set(res[section]) - {"seconds"} == {name for name, _, _ in gpu_check.TABLES}
        assert all(fig["exact"] is True for k, fig in res[section].items() if k != "seconds")
    assert all(res["copies"][name]["memcpy_gbs"] > 0 for name, _, _ in gpu_check.TABLES)
    assert {k: v["exact"] for k, v in res["engine"].items() if k != "seconds"} == dict.fromkeys(
        [b for b in ("loopback", "tcp", "nixl-all", "verbs") if b in transport.available() + transport.variants()],
        True)
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| 65536 x 4 KiB |" in table and "WRONG BYTES" not in table


@pytest.mark.skipif("nixl-all" not in transport.variants(), reason="nixl-cu12 is not installed")
def test_host_run_of_nixl_between_two_processes_names_ucx_transports(tmp_path: Path) -> None:
    rc = gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--only", "nixl"])
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 0, res
    assert all(fig["exact"] is True and fig["gbs"] > 0 for fig in res["nixl"]["tables"].values())
    # the full list's one-sided host transport on one machine carried the writes
    assert res["nixl"]["ucx_write_transports"] == ["cma"], res["nixl"]["ucx_write_protocols"]
    assert (tmp_path / "nixl_tx.log").stat().st_size > 0


@pytest.mark.skipif("verbs" in transport.available(), reason="an RDMA port is ACTIVE here: the section runs")
def test_the_verbs_section_is_skipped_with_the_reason_without_an_rdma_port(tmp_path: Path) -> None:
    rc = gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--quick", "--only", "verbs"])
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 0 and res["verbs"]["skipped"].startswith("no RDMA device"), res


def test_unknown_sections_are_refused() -> None:
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--out", "x", "--only", "copies,warp"])
