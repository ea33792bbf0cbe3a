"""One error tree for the host side.

    AgentenvError
    ├── RequestError              the caller asked for something wrong (4xx)
    │   ├── InvalidRequest        400: a field is malformed or out of range
    │   │   └── ImageTooLarge     400: an OCI image does not fit the requested disk size
    │   ├── NotFound              404: sandbox or template unknown
    │   │   ├── SandboxNotFound
    │   │   ├── TemplateNotFound
    │   │   ├── SnapshotNotFound
    │   │   ├── SandboxNotRunning 404 as E2B answers it: a paused sandbox's timeout
    │   │   └── ImageNotFound     404: the registry has no such image or tag
    │   ├── RegistryAuthFailed    401: the registry refused the (missing or given) credentials
    │   ├── ImageCorrupt          422: a blob fails its digest, a layer is truncated or corrupt
    │   ├── SandboxStateError     409: the sandbox is not in a state that allows this
    │   ├── IdempotencyKeyReused  422: an Idempotency-Key sent again with a different request
    │   ├── CapacityExhausted     429/503: the node is full
    │   └── GuestUnresponsive     503: an operation needs the guest agent, which does not answer
    └── PlatformError             the platform failed (5xx, never silent)
        ├── ProvisioningError     kernel / images / packages missing or failed to build
        ├── ExternalCommandError  a host command (qemu-img, ip, nft) failed
        ├── VmmError              QEMU failed to start, crashed, or QMP failed
        ├── NetworkError          namespace / tap / nft setup failed
        ├── GuestError            the guest agent did not answer or answered wrongly
        ├── RegistryUnreachable   504: a registry did not answer within the bound
        └── StorageError          disk full, missing or corrupt files
            ├── DiskFull          507: no space left
            └── SnapshotUnusable  422: a snapshot's layer is missing or fails its checksum
                └── ManifestDamaged   its manifest does not parse (it can only be deleted)

Each error carries a message that says what to fix. The HTTP status for each class is
mapped once, in ``agentenv.api.errors``.

``envd_client.EnvdError`` stays outside this tree on purpose: it carries the guest agent's own
Connect code (``not_found``, ``invalid_argument``, ``unavailable``...), which may be the
caller's fault or the guest's, so the API maps it by that code (``ENVD_STATUS``), not by
class; the orchestrator turns it into ``GuestError`` or ``GuestUnresponsive`` where the
platform needed the guest and it failed.
"""

from __future__ import annotations


class AgentenvError(Exception):
    """Root of every error AgentENV raises on purpose."""

    code: str = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class RequestError(AgentenvError):
    """The request cannot be carried out as asked; retrying it unchanged will fail again."""


class InvalidRequest(RequestError):
    code = "invalid_request"


class NotFound(RequestError):
    code = "not_found"


class SandboxNotFound(NotFound):
    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox '{sandbox_id}' not found")
        self.sandbox_id = sandbox_id


class SandboxFailed(SandboxNotFound):
    """A sandbox that failed (its VM died, its guest stopped answering) is gone for every
    operation on it, as E2B answers for one that died: a 404 whose message says why. Its
    record is kept for a while, for `GET` (410 with the reason) and listings to show."""

    def __init__(self, sandbox_id: str, reason: str | None) -> None:
        NotFound.__init__(self, f"sandbox '{sandbox_id}' failed: {reason or 'unknown reason'}; "
                                f"DELETE it to clear its record")
        self.sandbox_id = sandbox_id


class TemplateNotFound(NotFound):
    def __init__(self, template_id: str) -> None:
        super().__init__(
            f"template '{template_id}' not found; `aenv template ls` lists the available templates"
        )
        self.template_id = template_id


class SandboxNotRunning(NotFound):
    """A sandbox that exists but is paused, where E2B answers 404 (setting its timeout): the
    E2B SDKs raise their not-found exception on it, and code written for them catches that."""

    def __init__(self, sandbox_id: str, state: str, action: str) -> None:
        super().__init__(f"sandbox '{sandbox_id}' is {state}, not running; resume it (POST "
                         f"/sandboxes/{sandbox_id}/connect, or `aenv resume`) before {action}")
        self.sandbox_id = sandbox_id


class SnapshotNotFound(NotFound):
    def __init__(self, snapshot_id: str) -> None:
        super().__init__(f"snapshot '{snapshot_id}' not found; `aenv snapshot ls` lists the snapshots")
        self.snapshot_id = snapshot_id


class ImageNotFound(NotFound):
    code = "image_not_found"

    def __init__(self, reference: str, detail: str = "") -> None:
        super().__init__(f"image '{reference}' not found{': ' + detail if detail else ''}; "
                         "check the repository name and the tag or digest")
        self.reference = reference


class ImageTooLarge(InvalidRequest):
    code = "image_too_large"


class ImageCorrupt(RequestError):
    """An image's content does not match its digests. Retrying the same bytes cannot help; a
    corrupt cached copy is deleted so that the next pull fetches it again."""

    code = "image_corrupt"


class RegistryAuthFailed(RequestError):
    code = "registry_auth"

    def __init__(self, registry: str, *, credentials_given: bool, detail: str = "") -> None:
        given = ("the credentials given were rejected" if credentials_given
                 else "no credentials were given; the image may be private (or not exist)")
        super().__init__(f"registry {registry} refused access: {given}{' (' + detail + ')' if detail else ''}")
        self.registry = registry
        self.credentials_given = credentials_given


class SandboxStateError(RequestError):
    code = "conflict"

    def __init__(self, sandbox_id: str, state: str, required: str) -> None:
        super().__init__(f"sandbox '{sandbox_id}' is {state}; this operation needs it {required}")
        self.state = state
        self.required = required


class IdempotencyKeyReused(RequestError):
    code = "idempotency_key_reused"


class CapacityExhausted(RequestError):
    code = "capacity"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class GuestUnresponsive(RequestError):
    """An operation that needs the guest agent's help (a filesystem-only pause; a pause with
    ``requireHealthyGuest``) found it not answering; nothing was changed."""

    code = "guest_unresponsive"


class GuestUnresponsiveAtPause(SandboxStateError):
    """A paused sandbox whose guest agent did not answer when it was paused: its memory would
    bring the hung agent back. E2B's API answers this 409 with ``error_code``, which the SDKs
    raise as GuestUnresponsiveException ("resume with on_resume='reboot'")."""

    error_code = "sandbox_snapshot_guest_agent_unresponsive"

    def __init__(self, sandbox_id: str) -> None:
        RequestError.__init__(self, f"sandbox '{sandbox_id}' was paused while its guest agent did not answer; "
                                    f"restoring its memory would bring the hung agent back: resume it without its "
                                    f"memory (memory: false), which boots its disk")
        self.state, self.required = "paused", "paused with a guest agent that answered"


class PlatformError(AgentenvError):
    """The platform failed; the sandbox involved (if any) is marked error, never forgotten."""


class ProvisioningError(PlatformError):
    code = "provisioning"


class ExternalCommandError(PlatformError):
    code = "external_command"

    def __init__(self, argv: list[str], returncode: int, output: str) -> None:
        tail = output.strip()[-2000:]
        super().__init__(f"`{' '.join(argv[:4])}{' …' if len(argv) > 4 else ''}` exited {returncode}: {tail}")
        self.argv = argv
        self.returncode = returncode
        self.output = output


class VmmError(PlatformError):
    code = "vmm"


class NetworkError(PlatformError):
    code = "network"


class GuestError(PlatformError):
    code = "guest"


class RegistryUnreachable(PlatformError):
    code = "registry_unreachable"

    def __init__(self, registry: str, timeout_s: float, detail: str = "") -> None:
        super().__init__(f"registry {registry} unreachable or too slow (bound {timeout_s:g} s)"
                         f"{': ' + detail if detail else ''}")
        self.registry = registry
        self.timeout_s = timeout_s


class StorageError(PlatformError):
    code = "storage"


class DiskFull(StorageError):
    code = "disk_full"


class SnapshotUnusable(StorageError):
    """A snapshot cannot be restored as stored (a layer is missing or fails its checksum, or
    its base no longer exists). It is refused, never restored into a half-right sandbox."""

    code = "snapshot_unusable"


class ManifestDamaged(SnapshotUnusable):
    """A snapshot's manifest was read but does not parse (cut short by a host crash, or
    damaged): unlike a read that failed for a passing reason (EIO, EMFILE), it will not get
    better, and deleting it by id is safe."""
