from xinfer.hooks import BackendSpec, hookimpl


def is_available() -> bool:
    return True


@hookimpl
def xinfer_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="cpu",
            device_type="cpu",
            ops="xinfer_cpu.ops:CpuOps",
            is_available="xinfer_cpu.plugin:is_available",
            priority=0,
        )
    ]
