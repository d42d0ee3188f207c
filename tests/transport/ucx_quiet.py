"""Child for test_nixl's stdout test: a nixl transfer with UCX logging at debug, then "DONE".

UCX_LOG_LEVEL comes from the test (a user's choice); where the lines go is ours.
"""

from __future__ import annotations

import numpy as np
import torch

from pdxfer import transport

with transport.create("nixl") as a, transport.create("nixl") as b:
    src = a.register(torch.ones(4096, dtype=torch.uint8))
    dst = b.register(torch.zeros(4096, dtype=torch.uint8))
    a.connect(b.address()).write(src, dst.descriptor(), np.array([[0, 0, 4096]], np.int64)).wait(30)
print("DONE", flush=True)
