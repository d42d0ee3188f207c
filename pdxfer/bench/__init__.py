"""`pdxfer bench ...`: the benchmarks, apart from the engine they measure.

Each command is one module (`transport`, `engine`, `layouts`, `request_cost`,
`tp`, `chunked`, `scaling`), with a `main(argv) -> int` the CLI dispatches
to; `report` is what they share (progress, legend, `--json`, plots), `peer`
and `decode_peer` run a receiving side in a child process, `rate` and
`rawnixl` are pieces two benches use. Nothing in the engine imports from
here, and nothing here changes the engine or the transports for the rest of
the process: a bench that times a piece of a call wraps that piece on its
own engine's objects (`report.timed_pieces`), never on a class or module.

Kept empty of imports on purpose: `python -m pdxfer.bench.peer` (the child
process) and `pdxfer bench --help` pay for nothing they do not run.
"""
