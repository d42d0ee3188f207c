"""`pdxfer layout --example` prints the example model's entry maps, from layout's own answers."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from pdxfer.layout import EntryMajorArena, LayerMajorArena, describe, fingerprint, plan_segments

from pdxfer import cli, layout_example


def test_example_prints_every_pool_map(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["layout", "--example", "--pages", "3,4,5,9", "--slot", "5"]) == 0
    out = capsys.readouterr().out
    for pool in ("kv", "gdn_state", "compressor_state"):
        assert f"pool {pool} (entry_major" in out
    for pool in ("page_major_mha", "page_major_mamba"):
        assert pool in out
    # Each field line shows its offset and size as the arena computes them.
    arena = EntryMajorArena(layout_example.compressor_fields(), 4, "meta")
    for f in arena.fields:
        line = next(x for x in out.splitlines() if x.strip().startswith(f.name + " "))
        assert line.split()[-2:] == [str(arena.field_offset(f.name)), str(f.bytes_per_entry)]
        assert ("-inf" in line) == (f.fill == float("-inf"))
        assert line.split()[-3] == ("yes" if f.in_checkpoint else "no")
    assert f"checkpoint ranges (offset, bytes): {arena.checkpoint_ranges}" in out
    assert fingerprint(describe(arena))[:16] in out


def test_example_segment_counts_match_plan_segments(capsys: pytest.CaptureFixture[str]) -> None:
    assert layout_example.main(["--example", "--pages", "1,2,7"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "request entries [1, 2, 7]" in x)
    found = re.search(
        r"entry-major (\d+) segment\(s\) \((\d+) as a checkpoint image\), layer-major (\d+)", line
    )
    assert found, line
    entry_major, checkpoint, layer_major = map(int, found.groups())
    fields = layout_example.kv_fields()
    src, dst = np.array([1, 2, 7]), np.array([0, 1, 2])
    entry = EntryMajorArena(fields, layout_example.PAGES, torch.device("meta"))
    layer = LayerMajorArena(fields, layout_example.PAGES, torch.device("meta"))
    assert entry_major == plan_segments(entry, src, dst)[0].shape[0] == 2
    assert checkpoint == 2
    assert layer_major == plan_segments(layer, src, dst)[0].shape[0] == 2 * layout_example.ATTN_LAYERS * 2


def test_layout_without_example_says_what_it_needs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        layout_example.main([])
    assert exc.value.code == 2
    assert "nothing to print: pass --example" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        layout_example.main(["--example", "--pages", "1,x"])
