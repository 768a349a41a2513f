import logging

from xinfer.hooks import BackendSpec, hookimpl

log = logging.getLogger("xinfer")


def is_available() -> bool:
    """An Apple GPU through torch's ``mps`` device, with run-time shader compilation."""
    import torch

    if not torch.backends.mps.is_available():
        return False
    if not hasattr(torch.mps, "compile_shader"):
        log.warning("the metal backend needs torch.mps.compile_shader (torch >= 2.7); this torch %s lacks it: "
                    "upgrade torch to run on the Apple GPU", torch.__version__)  # fmt: skip
        return False
    return True


@hookimpl
def xinfer_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="metal",
            device_type="mps",
            ops="xinfer_metal.ops:MetalOps",
            is_available="xinfer_metal.plugin:is_available",
            priority=10,
            memory="xinfer_metal.memory:MetalMemory",
            one_device=True,
        )
    ]
