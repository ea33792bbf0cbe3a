"""The loopback registries and image builders the tests share with ``aenv bench``."""

from agentenv.bench.registry import (  # noqa: F401
    CREATED,
    BlackHole,
    BuiltImage,
    ClosedPort,
    LocalRegistry,
    build_busybox_image,
    build_debian_image,
    build_image_from_tars,
    debian_tarball,
    free_port,
)
