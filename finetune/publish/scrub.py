"""What must not leave the machine: local paths (they name the user's folders and say nothing to a reader) and
secrets. The recipe is published with every local path reduced to its file name and every secret-looking key's
value replaced; every text file about to be uploaded is searched for this machine's paths and for the token."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional

REDACTED = "<redacted>"
# A key whose value is a credential: a recipe never needs one, but a user's extension or a copied block may hold it.
# `token` and `hf_token` are secrets, `tokenizer` is not.
_SECRET_KEY = re.compile(r"(^|_)(token|secret|password|passwd|api_?key|credentials?)s?($|_)", re.IGNORECASE)


def looks_local(value: str) -> bool:
    """An absolute or home-relative path, or one of this machine's folders inside a longer string."""
    if value.startswith(("/", "~", "./", "../")) or re.match(r"^[A-Za-z]:[\\/]", value):
        return True
    return any(root in value for root in machine_roots())


def machine_roots() -> list[str]:
    """Folders whose names should never appear in published bytes: home, the working directory, the temp folder."""
    roots = {os.path.expanduser("~"), os.getcwd(), tempfile.gettempdir(), str(Path.cwd().resolve())}
    return sorted((r for r in roots if r and r not in ("/", ".")), key=len, reverse=True)


def scrub(value: Any, key: str = "") -> Any:
    """A copy of a recipe mapping with secrets replaced and local paths reduced to their last component."""
    if isinstance(value, dict):
        return {k: scrub(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v, key) for v in value]
    if isinstance(value, str):
        if _SECRET_KEY.search(key) and value:
            return REDACTED
        if looks_local(value):
            return Path(value.rstrip("/\\")).name or REDACTED
    return value


def leaks(data: bytes, token: Optional[str], extra_roots: Iterable[str] = ()) -> list[str]:
    """What in `data` must not be published: the token, this machine's folders (empty: nothing)."""
    found = []
    if token and token.encode() in data:
        found.append("the Hugging Face token")
    for root in [*machine_roots(), *extra_roots]:
        if root and root != "/" and root.encode() in data:
            found.append(f"the local path {root}")
    return found
