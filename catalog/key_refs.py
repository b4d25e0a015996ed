"""What a render config's ``obfuscation_key_ref`` may name: an obfuscation key, and nothing else.

The reference is resolved in the coordinator (``serving.obfuscation_keys``) and its key id shown
in the admin and the API. A reference to any setting or file would make the admin an oracle for
every secret the process can read: ``setting:SECRET_KEY`` or ``file:/etc/shadow`` showed a hash of
it (and whether the file exists). So a reference names only

- ``setting:MOTOR_OBFUSCATION_KEY`` or ``setting:MOTOR_OBFUSCATION_KEY_<NAME>``: an environment
  variable (or a Django setting) of that fixed prefix, which exists for nothing but this key;
- ``file:<path>`` under ``MOTOR_OBFUSCATION_KEY_DIR`` (symbolic links resolved first, so a link in
  the directory cannot point out of it): a mounted secret such as a Kubernetes Secret volume.

The admin form, the REST API and the import refuse any other reference (``InvalidKeyRef``), and
resolving one refuses it again, for rows stored before the rule.
"""

from __future__ import annotations

import re
from pathlib import Path

from django.conf import settings

ENV_PREFIX = "MOTOR_OBFUSCATION_KEY"
_ENV_NAME = rf"{ENV_PREFIX}(_[A-Z0-9_]+)?"
# Path segments under the key directory: no "." or ".." (nor hidden files), so the text alone
# says the file is inside; symbolic links are checked on the resolved path as well.
_SEGMENTS = r"(/[A-Za-z0-9_-][A-Za-z0-9._-]*)+"


class InvalidKeyRef(ValueError):
    """``obfuscation_key_ref`` names something that is not meant to hold an obfuscation key."""


def key_dir() -> Path:
    return Path(settings.MOTOR_OBFUSCATION_KEY_DIR)


def _escaped(text: str) -> str:
    # Regex metacharacters only, so the pattern reads the same to Python and to JSON Schema tools.
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", text)


def key_ref_pattern() -> str:
    """The references ``check_key_ref`` accepts, and "" (none), as one regular expression (the API's schema)."""
    return rf"^(setting:{_ENV_NAME}|file:{_escaped(str(key_dir()))}{_SEGMENTS})?$"


def check_key_ref(ref: str) -> tuple[str, str]:
    """Return ``(kind, where)`` of ``ref`` (``setting`` and a variable name, or ``file`` and a resolved path).

    Raises ``InvalidKeyRef`` saying what a reference may name (never reading what it names).
    """
    kind, _, where = ref.partition(":")
    if kind == "setting" and re.fullmatch(_ENV_NAME, where):
        return kind, where
    if kind == "file" and re.fullmatch(re.escape(str(key_dir())) + _SEGMENTS, where):
        root = key_dir().resolve()
        path = Path(where).resolve()
        if path.is_relative_to(root):
            return kind, str(path)
    raise InvalidKeyRef(
        f"obfuscation_key_ref {ref!r} names no obfuscation key: use `setting:{ENV_PREFIX}` or "
        f"`setting:{ENV_PREFIX}_<NAME>` (an environment variable of that name), or `file:<path>` of a file "
        f"under MOTOR_OBFUSCATION_KEY_DIR ({key_dir()})"
    )
