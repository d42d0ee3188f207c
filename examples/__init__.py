"""The PD example: a hybrid toy model served by a prefill and a decode worker.

Start with `python -m examples.launch_pd` (what `make demo` runs); see
examples/README.md for the moving parts and for running on two machines.
"""

import sys as _sys

# `python -m examples.X` is starting (runpy imports this package before X, with
# argv[0] still "-m"): Ctrl-C before X handles it prints one line, not an import
# traceback (examples/startup.py). An `import examples` elsewhere changes nothing.
if _sys.argv[:1] == ["-m"]:
    from .startup import quiet_start

    quiet_start()
