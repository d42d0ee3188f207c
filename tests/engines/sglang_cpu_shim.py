"""Test helper: lets SGLang's disaggregation modules import on a CPU-only machine.

`sglang.srt.configs` imports `torchvision.transforms` at module level for a
few multimodal model configs (deepseek_ocr, nano_nemotron_vl's internvl
utilities). PyPI's torchvision is a CUDA build that fails to load against
the CPU torch wheel, and nothing on the disaggregation path calls it, so the
pinned venv has no torchvision and this module stands in for the three
names those configs touch. Order matters: `import sglang` first, so that
transformers has already cached "torchvision is not available" (a stub seen
earlier makes it try `torchvision.io`); only then does the stub go in.

Deletion condition: SGLang importing torchvision lazily, or a CPU torchvision
wheel matching the pinned torch on the index the pins install from.
"""

import enum
import sys
import types

import sglang  # noqa: F401  (transformers decides "no torchvision" during this import)


class InterpolationMode(enum.Enum):
    """The members the configs name at import time (values as torchvision spells them)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _unavailable(*args, **kwargs):
    raise RuntimeError("torchvision is a stub in this test venv (tests/engines/sglang_cpu_shim.py)")


class _Transform:
    """Constructible at import time (configs build transform pipelines); refuses to run."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    __call__ = _unavailable


def _install() -> None:
    if "torchvision" in sys.modules:
        return
    root = types.ModuleType("torchvision")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    functional.InterpolationMode = transforms.InterpolationMode = InterpolationMode
    functional.__getattr__ = lambda name: _unavailable
    for name in ("Compose", "Lambda", "Resize", "ToTensor", "Normalize", "CenterCrop"):
        setattr(transforms, name, _Transform)
    transforms.functional, root.transforms, root.__version__ = functional, transforms, "0+stub"
    sys.modules.update({"torchvision": root, "torchvision.transforms": transforms,
                        "torchvision.transforms.functional": functional})


_install()
