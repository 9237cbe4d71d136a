"""A second NRI plugin for the end-to-end tests, shaped like the GPU Operator's CDI NRI plugin.

That plugin (the operator's ``cdi.nriPluginEnabled``) reads a pod's CDI annotations at
CreateContainer and injects the devices they name, with the mounts and environment of their CDI
specs, through the NRI adjustment. This one does the same for one made-up device: a container of a
pod annotated ``cdi.k8s.io/<any>: rekindle.test/dev=0`` gets the device node
``/dev/rekindle-cdi0`` (1:3, which the default device rules let a container open), the host
directory given on the command line bound read-only at ``/opt/cdi``, and ``CDI_TEST_DEVICE`` in its
environment.

    python -m tests.e2e.cdi_like_plugin SOCKET INDEX HOST_DIR
"""

from __future__ import annotations

import asyncio
import sys

from nri_plugin.proto import nri_api_pb2 as api
from nri_plugin.stub import Identity, Stub

DEVICE, MOUNT, ENV = "/dev/rekindle-cdi0", "/opt/cdi", "CDI_TEST_DEVICE"
ANNOTATION_VALUE = "rekindle.test/dev=0"


class CdiLike:
    def __init__(self, host_dir: str) -> None:
        self.host_dir = host_dir

    def create_container(self, pod: api.PodSandbox, ctr: api.Container) -> api.CreateContainerResponse:
        if not any(k.startswith("cdi.k8s.io/") and v == ANNOTATION_VALUE for k, v in pod.annotations.items()):
            return api.CreateContainerResponse()
        adjust = api.ContainerAdjustment()
        adjust.mounts.add(destination=MOUNT, type="bind", source=self.host_dir, options=["rbind", "ro"])
        adjust.env.add(key=ENV, value=DEVICE)
        dev = adjust.linux.devices.add(path=DEVICE, type="c", major=1, minor=3)
        dev.file_mode.value = 0o666
        print(f"injected {DEVICE} and {MOUNT} into {pod.name}/{ctr.name}", flush=True)
        return api.CreateContainerResponse(adjust=adjust)


def main() -> None:
    sock, idx, host_dir = sys.argv[1:4]
    asyncio.run(Stub(CdiLike(host_dir), Identity("cdi-like", idx), socket_path=sock).run())


if __name__ == "__main__":
    main()
