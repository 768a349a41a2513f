from xinfer.hooks import BackendSpec, hookimpl


def is_available() -> bool:
    import torch

    return torch.cuda.is_available()


@hookimpl
def xinfer_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="cuda",
            device_type="cuda",
            ops="xinfer_cuda.ops:CudaOps",
            is_available="xinfer_cuda.plugin:is_available",
            priority=10,
            memory="xinfer_cuda.memory:CudaMemory",
        )
    ]
