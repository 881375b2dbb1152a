"""Where the cluster's shared secret comes from: one resolution for the config's validation and
for every process's `Security` (common/security.py).

Order: the YAML value `security.shared_secret`, else the file `security.shared_secret_file`
(surrounding whitespace removed), else the environment variable PDSERVE_SHARED_SECRET.
With none of them, `pdserve serve` / `pdserve up` make one per deployment (`generate_secret`) and
hand it to their actors as a `HandedSecret` (deploy/controller.py).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

SECRET_ENV = "PDSERVE_SHARED_SECRET"
MIN_SECRET_CHARS = 16


def read_secret_file(path: str) -> str:
    """The secret stored in `path`, surrounding whitespace (a trailing newline) removed."""
    return Path(path).read_text().strip()


def secret_source(shared_secret: str = "", shared_secret_file: str = "") -> tuple[str, str]:
    """(secret, where it came from): "shared_secret", "shared_secret_file" or SECRET_ENV.

    Raises OSError / UnicodeDecodeError when the file cannot be read."""
    if shared_secret:
        return shared_secret, "shared_secret"
    if shared_secret_file:
        return read_secret_file(shared_secret_file), "shared_secret_file"
    return os.environ.get(SECRET_ENV, ""), SECRET_ENV


def resolve_secret(shared_secret: str = "", shared_secret_file: str = "") -> str:
    """The configured secret (empty: none)."""
    return secret_source(shared_secret, shared_secret_file)[0]


def generate_secret() -> str:
    """A fresh random cluster secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class HandedSecret:
    """A secret handed from one process to another (a Ray actor's constructor argument): its
    repr, str and every log line or traceback that prints it show no secret."""

    value: str = field(repr=False)

    def __str__(self) -> str:
        return repr(self)
