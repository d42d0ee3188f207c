"""The PD example: a hybrid toy model served by a prefill and a decode worker.

Start with `python -m examples.launch_pd` (what `make demo` runs); see
examples/README.md for the moving parts and for running on two machines.
"""
